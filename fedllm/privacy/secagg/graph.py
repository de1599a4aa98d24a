"""The neighbour graph of a round: a random ``k``-regular Harary graph (Bell et al., §3.2 and App. B).

The round's clients are placed on a ring in an order drawn from a public seed (SHA-256 of the seed and the
clients, so every party computes the same graph without a message; the order is public and needs no secrecy),
and each is joined to the ``⌈k/2⌉`` clients on either side: every client has ``k`` neighbours rounded up to even,
at most ``n − 1`` (``k ≥ n − 1``: the complete graph of the original SecAgg).
"""

from __future__ import annotations

import hashlib
import random


def neighbour_graph(client_ids: list[int], k: int, seed: bytes) -> dict[int, list[int]]:
    """``{client: sorted neighbours}``; every client has :meth:`SecAggParams.effective_neighbours` of them."""
    ids = sorted(set(client_ids))
    n = len(ids)
    if k >= n - 1:
        return {c: [v for v in ids if v != c] for c in ids}
    order = list(ids)
    random.Random(hashlib.sha256(seed + repr(ids).encode()).digest()).shuffle(order)
    half = (k + 1) // 2
    out: dict[int, set[int]] = {c: set() for c in ids}
    for i, c in enumerate(order):
        for j in range(1, half + 1):
            v = order[(i + j) % n]
            out[c].add(v)
            out[v].add(c)
    return {c: sorted(v) for c, v in out.items()}
