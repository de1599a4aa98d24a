"""The server's side of a SecAgg+ round: it routes keys and encrypted shares, collects the masked inputs and,
from the shares the survivors reveal, removes the masks — learning ``Σ_{u ∈ U3} x_u mod 2^mod_bits`` and
nothing else about any one input (Bell et al., CCS 2020; semi-honest server, up to ``t − 1`` colluding clients
per neighbourhood).

Sets of clients as in the paper: ``U1`` advertised keys, ``U2 ⊆ U1`` sent their shares, ``U3 ⊆ U2`` sent a
masked input, ``U4 ⊆ U3`` signed the survivor list ``U3`` in the consistency check (Bonawitz et al., CCS 2017, §4:
the server forwards the signatures, and a client reveals its shares only when a quorum of them verify over the list
it signed itself). The round completes when at most ``max_dropouts`` clients of ``U2`` are missing from ``U3``, a
quorum (:meth:`SecAggParams.quorum`) signed ``U3`` and every needed secret gets ``threshold`` shares; otherwise
:class:`SecAggError` says which and why.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from fedllm.privacy.secagg import crypto, identity, masks
from fedllm.privacy.secagg.client import mask_sign, pair_info
from fedllm.privacy.secagg.graph import neighbour_graph
from fedllm.privacy.secagg.messages import (
    EncryptedShare,
    KeyAdvert,
    MaskedInput,
    ShareReveal,
    SurvivorSignature,
    UnmaskRequest,
)
from fedllm.privacy.secagg.params import SecAggError, SecAggParams
from fedllm.privacy.secagg.quantize import word_dtype


class SecAggServer:
    """The server's state in one round (see the module docstring); arguments as :class:`SecAggClient`'s, and
    ``peer_keys``: the registered public keys the survivors' signatures are checked against (``None``: unchecked here;
    the clients check them)."""

    def __init__(self, params: SecAggParams, client_ids: list[int], graph_seed: bytes, context: bytes,
                 peer_keys: dict | None = None):
        problems = params.problems(len(set(client_ids)))
        if problems:
            raise SecAggError("; ".join(f"{key} must be {what}" for key, what in problems))
        self.params, self.context = params, context
        self.graph = neighbour_graph(client_ids, params.neighbours, graph_seed)
        self.adverts: dict[int, KeyAdvert] = {}
        self.u2: set[int] = set()
        self.inputs: dict[int, np.ndarray] = {}
        self.request: UnmaskRequest | None = None
        self.round_size, self.peer_keys = len(set(client_ids)), peer_keys
        self.signers: dict[int, bytes] = {}  # U4: who signed U3, and their signatures

    # stage 1
    def route_keys(self, adverts: list[KeyAdvert]) -> dict[int, list[KeyAdvert]]:
        """Each advertising client's neighbours' keys (``U1``: the clients that advertised)."""
        self.adverts = {a.client_id: a for a in adverts if a.client_id in self.graph}
        if len(self.adverts) < self.params.quorum(self.round_size):
            raise SecAggError(
                f"{len(self.adverts)} clients advertised keys, fewer than {self.params.quorum_text(self.round_size)}: "
                "the round cannot complete"
            )
        out = {u: [self.adverts[v] for v in self.graph[u] if v in self.adverts] for u in self.adverts}
        self._enough({u: len(v) for u, v in out.items()}, "neighbours advertised keys")
        return out

    # stage 2
    def route_shares(self, shares: list[EncryptedShare]) -> dict[int, list[EncryptedShare]]:
        """The shares each client of ``U2`` (those that sent shares) receives from the others of ``U2``."""
        self.u2 = {s.sender for s in shares if s.sender in self.adverts}
        out: dict[int, list[EncryptedShare]] = {u: [] for u in self.u2}
        for s in shares:
            if s.sender in self.u2 and s.receiver in self.u2:
                out[s.receiver].append(s)
        self._enough({u: len(v) for u, v in out.items()}, "neighbours sent shares")
        return out

    # stage 3
    def collect_masked(self, inputs: list[MaskedInput]) -> UnmaskRequest:
        """Keep the masked inputs of ``U2``'s clients; the survivors and the clients dropped after sharing."""
        dtype = word_dtype(self.params)
        self.inputs = {m.client_id: np.asarray(m.vector) for m in inputs if m.client_id in self.u2}
        sizes = {v.size for v in self.inputs.values()}
        if len(sizes) > 1 or any(v.dtype != dtype for v in self.inputs.values()):
            raise SecAggError(f"masked inputs of different lengths or types: {sorted(sizes)}")
        dropped = tuple(sorted(self.u2 - set(self.inputs)))
        if len(dropped) > self.params.max_dropouts:
            raise SecAggError(
                f"{len(dropped)} clients ({list(dropped)}) were lost after sharing their keys, more than "
                f"max_dropouts={self.params.max_dropouts}: the round cannot complete"
            )
        if not self.inputs:
            raise SecAggError("no masked input arrived")
        quorum = self.params.quorum(self.round_size)
        if len(self.inputs) < quorum:  # the survivors would refuse to sign (SecAggClient.check)
            raise SecAggError(
                f"{len(self.inputs)} masked inputs arrived, fewer than {self.params.quorum_text(self.round_size)}: "
                "the survivors would refuse to sign their list, the round cannot complete"
            )
        self.request = UnmaskRequest(tuple(sorted(self.inputs)), dropped)
        return self.request

    # consistency check
    def collect_signatures(self, signatures: list[SurvivorSignature]) -> dict[int, bytes]:
        """The survivors' signatures of ``U3`` to forward to each of them (``U4``: the survivors that signed, and
        whose signature verifies when the server holds the registered keys); fewer than the quorum fail the round."""
        if self.request is None:
            raise SecAggError("consistency check before the masked inputs were collected")
        got = {s.client_id: s.signature for s in signatures if s.client_id in self.request.survivors}
        refused: dict[int, str] = {}
        if self.peer_keys is not None:
            valid, refused = identity.survivor_signers(self.peer_keys, self.context, self.request.survivors, got)
            got = {c: got[c] for c in valid}
        quorum = self.params.quorum(self.round_size)
        if len(got) < quorum:
            why = "".join(f"; client {c}: {r}" for c, r in refused.items())
            raise SecAggError(
                f"{len(got)} survivors signed the survivor list, fewer than {self.params.quorum_text(self.round_size)}"
                f"{why}: the round cannot complete"
            )
        self.signers = got
        return got

    # stage 4
    def unmask(self, reveals: list[ShareReveal]) -> np.ndarray:
        """``Σ_{u ∈ U3} x_u mod 2^mod_bits`` from the masked inputs and the survivors' revealed shares."""
        if self.request is None:
            raise SecAggError("unmask before the masked inputs were collected")
        if not self.signers:
            raise SecAggError("unmask before the survivors signed their list (the consistency check)")
        survivors, dropped = set(self.request.survivors), set(self.request.dropped)
        dtype = word_dtype(self.params)
        got: dict[tuple[int, str], dict[int, bytes]] = defaultdict(dict)
        for r in reveals:
            wanted = (r.kind == "seed" and r.owner in survivors) or (r.kind == "key" and r.owner in dropped)
            if wanted and r.holder in self.signers and r.holder in self.graph.get(r.owner, ()):
                got[(r.owner, r.kind)][r.index] = r.share
        total = np.zeros(next(iter(self.inputs.values())).size, dtype=dtype)
        for y in self.inputs.values():
            total = total + y
        for u in sorted(survivors):
            total = total - masks.expand(self._rebuild(got[(u, "seed")], u, "self-mask seed"), total.size, dtype)
        for u in sorted(dropped):
            sk = crypto.private_key(self._rebuild(got[(u, "key")], u, "masking key"))
            _, public = crypto.public_of(sk)
            if public != self.adverts[u].masking_key:
                raise SecAggError(f"the masking key rebuilt for dropped client {u} does not match its advertised key")
            for v in self.graph[u]:
                if v in survivors:  # v masked with u (both in U2): remove v's half of the pair
                    seed = crypto.agree(sk, self.adverts[v].masking_key, pair_info(b"mask", self.context, u, v))
                    pair = masks.expand(seed, total.size, dtype)
                    total = total - pair if mask_sign(v, u) > 0 else total + pair
        return total

    def _rebuild(self, shares: dict[int, bytes], owner: int, what: str) -> bytes:
        t = self.params.threshold
        if len(shares) < t:
            raise SecAggError(
                f"{len(shares)} shares of client {owner}'s {what} arrived, fewer than the share "
                f"threshold {t}: the round cannot complete"
            )
        return crypto.combine(dict(sorted(shares.items())[:t]))

    def _enough(self, counts: dict[int, int], what: str) -> None:
        short = {u: n for u, n in counts.items() if n < self.params.threshold}
        if short:
            raise SecAggError(f"clients {sorted(short)}: fewer than threshold={self.params.threshold} {what} ({short})")
