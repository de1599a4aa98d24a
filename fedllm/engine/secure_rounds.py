"""SecAgg+ between the simulated clients of a round (``privacy.secure_aggregation: secagg_plus``), in one process
or over torch.distributed processes: the protocol of :mod:`fedllm.privacy.secagg`, its messages carried by
:meth:`fedllm.engine.distributed.Dispatch.exchange` (every process runs the server's steps on the same messages).

Per round: every sampled client advertises keys and exchanges encrypted shares before it trains (on the process
that trains it, which alone holds its secrets); after training it uploads only its masked, quantised change
(``MASKED_KEY``: int32/int64 words, gathered like any update); a client lost in between (training fault, non-finite
update) is a dropout after sharing. The survivors sign the survivor list (the consistency check of Bonawitz et al.,
CCS 2017, §4, with simulated identity keys: :func:`fedllm.privacy.secagg.identity.simulated`) and reveal their
shares only for a list a quorum signed. The server's steps then unmask the *sum*, and the strategy aggregates from the
round's mean upload (:meth:`fedllm.strategies.Strategy.aggregate_mean`) — no process's round loop ever holds a
client's update in the clear. Quantisation rounds stochastically with a generator seeded by (seed, round,
client): it hides nothing (the mask does), and it makes a run on N processes equal to the one-process run.

The server's side (:class:`SecureRoundServer`: parameters, layout, unmasking into the mean upload) and the client's
masking (:func:`mask_upload`) are shared with Flower (:mod:`fedllm.flower.secagg_stages`), where the same stages
travel as messages between the ServerApp and the node workers: a Flower run equals the one-process run bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedllm.engine import client_faults
from fedllm.models.state import DTYPES, StateDict, cast
from fedllm.privacy import client_stats
from fedllm.privacy.secagg import (
    EncryptedShare,
    MaskedInput,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    ShareReveal,
    SurvivorSignature,
    UnmaskRequest,
    identity,
)
from fedllm.privacy.secagg.encoding import Layout, decode, encode, layout_of
from fedllm.privacy.secagg.quantize import word_dtype
from fedllm.privacy.secagg.settings import round_params
from fedllm.recipe.schedule import derived_seed
from fedllm.strategies import ClientUpdate

log = logging.getLogger("fedllm")

MASKED_KEY = "secagg/masked"
"""The only entry of a client's upload under secure aggregation: its masked words (int32/int64 view of uint)."""


@dataclasses.dataclass
class SummedUpdate(ClientUpdate):
    """A surviving client after unmasking: ``state`` is the round's mean upload (never its own); ``wire_bytes`` what
    it sent (masked words and its protocol messages)."""

    wire_bytes: int = 0


def round_names(seed: int, rnd: int, sampled: list[int], salt: bytes = b"") -> tuple[bytes, bytes]:
    """``(graph_seed, context)`` of a round: public, computed alike by every process (``salt``: what else names the
    round on a transport, e.g. Flower's run token and a fresh nonce per attempt)."""
    name = hashlib.sha256(repr(("fedllm-secagg", seed, rnd, sorted(sampled))).encode() + salt).digest()
    return name[:16], name[16:]


def mask_upload(update: ClientUpdate, reference: StateDict, weight: int, seed: int, rnd: int, layout: Layout,
                params: SecAggParams, client: SecAggClient, shares: list[EncryptedShare],
                per_client_stats: bool = False) -> ClientUpdate:
    """Client side (simulated or a Flower node): ``update`` (valid, in the wire dtype, trained from ``reference``)
    as its masked words only (``MASKED_KEY``), without its loss and token counts unless ``per_client_stats``
    (``privacy.per_client_stats``). Quantisation rounds with a generator seeded by (seed, round, client), so every
    transport computes the same words."""
    rng = np.random.default_rng(derived_seed(seed, rnd, update.client_id, 0x5EC))
    words, _ = encode(update.state, reference, weight, layout, params, rng)
    masked = client.mask(words, shares)
    signed = masked.vector.view(np.int32 if masked.vector.dtype == np.uint32 else np.int64)
    if not per_client_stats:  # its loss and token counts stay with it (fedllm.privacy.client_stats)
        update = client_stats.withhold(update)
    return dataclasses.replace(update, state={MASKED_KEY: torch.from_numpy(signed.copy())})


def masked_words(update: ClientUpdate, params: SecAggParams) -> MaskedInput:
    """The server's view of a masked upload: its words as unsigned integers modulo ``2^mod_bits``."""
    return MaskedInput(update.client_id, update.state[MASKED_KEY].numpy().view(word_dtype(params)))


class SecureRoundServer:
    """The server's side of one round, whatever carries the messages: the public parameters, the layout of the
    uploads, the protocol's server state, and unmasking the sum into the surviving clients' mean upload.

    Args:
        loop: the round loop (recipe, strategy, model, global state, data).
        rnd: the round.
        sampled: the round's clients.
        salt: more bytes naming the round (:func:`round_names`).
        peer_keys: the clients' registered public keys the survivors' signatures are checked against.
    """

    def __init__(self, loop: Any, rnd: int, sampled: list[int], salt: bytes = b"", peer_keys: dict | None = None):
        recipe, strategy = loop.recipe, loop.fed.strategy
        self.loop, self.rnd = loop, rnd
        sizes = [len(loop.fed.data.clients[c]) for c in sampled]
        total = sum(strategy.sum_weight(ClientUpdate(c, {}, n, 0.0, 0)) for c, n in zip(sampled, sizes, strict=True))
        self.params = round_params(recipe.privacy.secagg, len(sampled), total)
        self.graph_seed, self.context = round_names(recipe.seed, rnd, sampled, salt)
        plan = strategy.configure_client(rnd, sampled[0], loop.global_state)
        expected = client_faults.expected_upload(strategy, plan, loop.model)
        if expected is None:
            raise SecAggError(
                f"{recipe.federation.strategy}: its upload's layout cannot be derived from the model, "
                "which secure aggregation needs (the server decodes the sum by it)"
            )
        self.dtypes = {k: dtype for k, (_, dtype) in expected.items()}
        self.layout = layout_of(
            {k: torch.empty(shape, device="meta") for k, (shape, _) in expected.items()},
            lambda k: not strategy.summed_unweighted(k),
        )
        self.server = SecAggServer(self.params, sampled, self.graph_seed, self.context, peer_keys)
        self.sent: dict[int, int] = {}  # protocol bytes each counted client sent
        self.received: dict[int, int] = {}

    def masked_upload_layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a client's masked upload must look like (:func:`fedllm.engine.client_faults.update_problem`)."""
        return {MASKED_KEY: ((self.layout.size,), torch.int32 if self.params.mod_bits == 32 else torch.int64)}

    def finish(self, updates: list[ClientUpdate], check: Callable[[UnmaskRequest], list[SurvivorSignature]],
               reveal: Callable[[UnmaskRequest, dict[int, bytes]], list[ShareReveal]]
               ) -> tuple[list[ClientUpdate], dict[int, str], dict[str, Any]]:
        """The survivors as :class:`SummedUpdate` s carrying the round's mean upload, the clients dropped by the
        protocol (all of them when it fails: the round is then retried or stopped as any round without enough
        updates), and the round's ``secure_aggregation`` record. ``check(request)``: the survivors' signatures of
        the survivor list; ``reveal(request, signatures)``: their share reveals once each got the signatures
        (however they travel)."""
        comm = self.loop.recipe.federation.comm_dtype
        try:
            request = self.server.collect_masked([masked_words(u, self.params) for u in updates])
            signed = check(request)
            signatures = self.server.collect_signatures(signed)
            reveals = reveal(request, signatures)
            decoded = decode(self.server.unmask(reveals), self.layout, self.params)
        except SecAggError as e:
            log.warning("round %d: secure aggregation failed: %s", self.rnd, e)
            return [], {u.client_id: f"secure aggregation failed: {e}" for u in updates}, {}
        reference = self.reference(request.survivors)
        means = decoded.means(self.layout)
        mean = {k: (reference[k].double() + v if k in reference else v).to(self.dtypes[k]) for k, v in means.items()}
        for r in reveals:
            if r.holder in self.sent:
                self.sent[r.holder] += len(r.share) + 24
        for s in signed:
            if s.client_id in self.sent:
                self.sent[s.client_id] += len(s.signature) + 8
        lists = 8 * (len(request.survivors) + len(request.dropped))  # sent with the check and with the unmasking
        forwarded = sum(len(s) + 8 for s in signatures.values())
        for c in request.survivors:
            if c in self.received:
                self.received[c] += 2 * lists + forwarded
        nbytes = {u.client_id: u.state[MASKED_KEY].numel() * u.state[MASKED_KEY].element_size() for u in updates}
        out = [
            SummedUpdate(u.client_id, mean, u.num_examples, u.loss, u.steps, u.padding,
                         wire_bytes=nbytes[u.client_id], work=u.work)
            for u in updates
            if u.client_id in request.survivors
        ]
        plain = sum(int(np.prod(s)) * DTYPES[comm].itemsize for s in self.layout.shapes)
        record = {
            "mod_bits": self.params.mod_bits,
            "quantization_step": self.params.step,
            "threshold": self.params.threshold,
            "neighbours": self.params.effective_neighbours(len(self.server.graph)),
            "dropped_after_sharing": list(request.dropped),
            "clipped_values": decoded.clipped,
            "masked_bytes_per_client": self.layout.size * word_dtype(self.params).itemsize,
            "plain_bytes_per_client": plain,
        }
        return out, {c: "lost after the secure-aggregation share exchange" for c in request.dropped}, record

    def reference(self, survivors: tuple[int, ...]) -> StateDict:
        """What the survivors started from (their plans' states as the wire carried them): one state for all, as a
        sum strategy sends every client the same."""
        strategy, loop, comm = self.loop.fed.strategy, self.loop, self.loop.recipe.federation.comm_dtype
        states = [cast(strategy.configure_client(self.rnd, c, loop.global_state).state, comm) for c in survivors]
        for c, s in zip(survivors[1:], states[1:], strict=True):
            if s.keys() != states[0].keys() or any(not torch.equal(s[k], states[0][k]) for k in s):
                raise SecAggError(
                    f"client {c} was sent another state than client {survivors[0]}: the mean of their "
                    "changes has no one reference to add back"
                )
        return states[0]


class SecureRound(SecureRoundServer):
    """One round's protocol on this process (simulation): the server's state and the secrets of the clients
    trained here.

    Args:
        loop: the round loop (recipe, strategy, model, global state, data).
        rnd: the round.
        sampled: the round's clients (all processes).
        local: those trained on this process.
        exchange: every process's list of messages, concatenated in rank order (the identity on one process).
    """

    def __init__(self, loop: Any, rnd: int, sampled: list[int], local: list[int], exchange: Callable[[list], list]):
        super().__init__(loop, rnd, sampled)
        self.exchange = exchange
        who, registered = identity.simulated(local, exchange)
        self.server.peer_keys = registered
        self.clients = {c: SecAggClient(c, self.params, sampled, self.graph_seed, self.context, who[c]) for c in local}
        self.sent, self.received = dict.fromkeys(local, 0), dict.fromkeys(local, 0)
        adverts = exchange([c.advertise() for c in self.clients.values()])
        keys = self.server.route_keys(adverts)
        shares = exchange([s for c in self.clients.values() for s in c.share_keys(keys[c.id])])
        self.routed = self.server.route_shares(shares)
        for c in self.clients:
            self.sent[c] += 64 + sum(len(s.sealed) + 16 for s in shares if s.sender == c)
            self.received[c] += 64 * len(keys[c]) + sum(len(s.sealed) + 16 for s in self.routed.get(c, []))

    def mask(self, update: ClientUpdate, reference: StateDict) -> ClientUpdate:
        """Client side: ``update`` (a valid one, trained here from ``reference``) as its masked words only."""
        cid = update.client_id
        return mask_upload(update, reference, self.loop.fed.strategy.sum_weight(update), self.loop.recipe.seed,
                           self.rnd, self.layout, self.params, self.clients[cid], self.routed.get(cid, []),
                           per_client_stats=self.loop.recipe.privacy.per_client_stats)

    def finish(self, updates: list[ClientUpdate]) -> tuple[list[ClientUpdate], dict[int, str], dict[str, Any]]:
        """Server side, on every process (:meth:`SecureRoundServer.finish`); the signatures and reveals of the
        clients trained here, exchanged between the processes."""
        def check(request: UnmaskRequest) -> list[SurvivorSignature]:
            return self.exchange([SurvivorSignature(c, self.clients[c].check(request))
                                  for c in request.survivors if c in self.clients])

        def reveal(request: UnmaskRequest, signatures: dict[int, bytes]) -> list[ShareReveal]:
            return self.exchange([r for c in signatures if c in self.clients
                                  for r in self.clients[c].unmask(request, signatures)])

        return super().finish(updates, check, reveal)

    def protocol_bytes(self) -> tuple[dict[int, int], dict[int, int]]:
        """``(sent, received)`` protocol bytes (keys, shares, the unmasking request and reveals) of every client of
        the round, from every process (call on every process)."""
        rows = self.exchange([(c, self.sent[c], self.received[c]) for c in self.clients])
        return {c: s for c, s, _ in rows}, {c: r for c, _, r in rows}
