"""One whole SecAgg+ round among clients held in this process (tests, benchmarks): the stages in order — keys, shares,
masked inputs, the consistency check (with simulated identity keys, :func:`fedllm.privacy.secagg.identity.simulated`),
unmasking — with an ``exchange`` hook where a transport would carry each stage's messages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedllm.privacy.secagg import identity
from fedllm.privacy.secagg.client import SecAggClient
from fedllm.privacy.secagg.messages import MaskedInput, SurvivorSignature, UnmaskRequest
from fedllm.privacy.secagg.params import SecAggParams
from fedllm.privacy.secagg.server import SecAggServer


@dataclass
class RoundResult:
    """What a round produced: the unmasked sum, who survived and dropped, and what the server received."""

    total: np.ndarray
    request: UnmaskRequest
    received: list[MaskedInput]  # the masked inputs as the server saw them
    message_bytes: dict[str, int]  # bytes of each stage's messages, all clients together (keys, shares, signatures,
    # reveals)


def secure_sum(
    params: SecAggParams,
    inputs: dict[int, np.ndarray],
    graph_seed: bytes,
    context: bytes,
    lost_after_sharing: frozenset[int] = frozenset(),
    exchange: Callable[[list], list] = list,
) -> RoundResult:
    """``Σ inputs mod 2^mod_bits`` over the clients not in ``lost_after_sharing`` (those complete stages 1-2,
    then send nothing), computed by the protocol: the server object only sees masked inputs and shares."""
    ids = sorted(inputs)
    who, registered = identity.simulated(ids)
    clients = {c: SecAggClient(c, params, ids, graph_seed, context, who[c]) for c in ids}
    server = SecAggServer(params, ids, graph_seed, context, registered)
    adverts = exchange([c.advertise() for c in clients.values()])
    keys = server.route_keys(adverts)
    shares = exchange([s for c in clients.values() for s in c.share_keys(keys[c.id])])
    routed = server.route_shares(shares)
    received = exchange([clients[c].mask(inputs[c], routed[c]) for c in ids if c not in lost_after_sharing])
    request = server.collect_masked(received)
    signed = exchange([SurvivorSignature(c, clients[c].check(request)) for c in request.survivors])
    signatures = server.collect_signatures(signed)
    reveals = exchange([r for c in signatures for r in clients[c].unmask(request, signatures)])
    sizes = {
        "keys": 64 * len(adverts),
        "shares": sum(len(s.sealed) + 16 for s in shares),
        "signatures": sum(len(s.signature) + 8 for s in signed),
        "reveals": sum(len(r.share) + 20 for r in reveals),
    }
    return RoundResult(server.unmask(reveals), request, received, sizes)
