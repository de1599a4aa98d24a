"""Clients of different LoRA ranks on one shared adapter (FlexLoRA, FLoRA).

The model holds one PEFT adapter of rank ``R = lora.r``. Client ``k`` has its own rank ``r_k <= R``: it
trains the first ``r_k`` rows of ``A`` and columns of ``B`` while the rest stay exactly zero (a zero row of
``A`` and the matching zero column of ``B`` get zero gradients, and AdamW/SGD leave a zero parameter with
a zero gradient at zero). On the wire it receives and sends only its rank-``r_k`` factors: the server's
plan holds ``out × r_k`` / ``r_k × in`` tensors (so the download bytes count ``r_k``), the client pads them
with zeros to ``R`` before training (:meth:`RankedClients.open_client`) and uploads the first ``r_k`` again
(:meth:`RankedClients.client_upload`).

Scaling: every client computes ``s·B_k A_k`` with the adapter's ``s = alpha / R``, i.e. a rank-``r_k``
client is a LoRA with ``alpha_k = alpha · r_k / R``. The products of all clients are then on one scale and
an SVD hand-back at full rank reproduces the update exactly.

Ranks come from ``client_ranks``: a list (one rank per client), or the name of a resource distribution
over four rank levels (FlexLoRA, Bai et al. 2024, §5 and Fig. 3: four LoRA configuration types mixed in
the proportions of a ``uniform``, ``heavy_tail_light`` (most clients at the lowest level), ``heavy_tail_strong``
(most at the highest) or ``normal`` (most in the middle two) distribution). The paper shows the proportions
only as bars; the values of :data:`DISTRIBUTIONS` are this toolkit's reading of them.
"""

from __future__ import annotations

from typing import Any

import torch

from fedllm.common.errors import InputError
from fedllm.models.state import StateDict

DISTRIBUTIONS: dict[str, tuple[float, float, float, float]] = {
    "uniform": (0.25, 0.25, 0.25, 0.25),
    "heavy_tail_light": (0.7, 0.1, 0.1, 0.1),
    "heavy_tail_strong": (0.1, 0.1, 0.1, 0.7),
    "normal": (0.1, 0.4, 0.4, 0.1),
}
RANKS_KEY = "federation.strategy_args.client_ranks"


def default_levels(r: int) -> list[int]:
    """The four rank levels under an adapter of rank ``r``: ``r/8, r/4, r/2, r`` (at least 1)."""
    return [max(1, r // 8), max(1, r // 4), max(1, r // 2), r]


def _positive_ints(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in value)


def check_rank_args(args: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """Problems with ``client_ranks`` / ``rank_levels`` as ``(key, given, expected)``."""
    problems = []
    ranks = args.get("client_ranks")
    if ranks is not None and not (_positive_ints(ranks) or ranks in DISTRIBUTIONS):
        problems.append(("client_ranks", ranks, "a list of positive integers, one per client, or one of "
                         + ", ".join(DISTRIBUTIONS)))
    levels = args.get("rank_levels")
    if levels is not None and not (_positive_ints(levels) and len(levels) == 4):
        problems.append(("rank_levels", levels, "a list of 4 positive integers (the resource levels' ranks)"))
    return problems


def assign_ranks(spec: Any, num_clients: int, max_rank: int, levels: list[int] | None = None,
                 seed: int = 0) -> list[int]:
    """Rank of every client from ``spec`` (a list, a distribution name, or None: all at ``max_rank``).

    A distribution gives each level ``round(p · N)`` clients (largest remainders first, ties to the lower
    level); which client gets which level is a permutation seeded by ``seed``.

    Raises:
        InputError: a list of the wrong length, or a rank above ``max_rank``.
    """
    if spec is None:
        return [max_rank] * num_clients
    if isinstance(spec, str):
        levels = list(levels) if levels is not None else default_levels(max_rank)
        shares = [p * num_clients for p in DISTRIBUTIONS[spec]]
        counts = [int(s) for s in shares]
        by_remainder = sorted(range(4), key=lambda i: (-(shares[i] - counts[i]), i))
        for i in by_remainder[:num_clients - sum(counts)]:
            counts[i] += 1
        ordered = [lvl for lvl, n in zip(levels, counts, strict=True) for _ in range(n)]
        order = torch.randperm(num_clients, generator=torch.Generator().manual_seed(seed)).tolist()
        ranks = [ordered[i] for i in order]
    else:
        ranks = [int(x) for x in spec]
        if len(ranks) != num_clients:
            raise InputError(f"{RANKS_KEY}: got {len(ranks)} ranks for {num_clients} clients; expected one per client")
    if max(ranks) > max_rank:
        raise InputError(f"{RANKS_KEY}: rank {max(ranks)} is above lora.r={max_rank}, the shared adapter's rank; "
                         f"expected ranks in 1..{max_rank}")
    return ranks


class RankedClients:
    """Mixin: per-client ranks on one padded adapter (needs ``self.layers`` from ``adapter_layers``).

    Call :meth:`setup_ranks` in ``setup``; :meth:`truncate` a state to a client's rank for its plan.
    """

    client_ranks: Any = None
    rank_levels: list[int] | None = None
    layers: dict
    seed: int

    def setup_ranks(self, num_clients: int) -> None:
        """Resolve ``client_ranks`` into :attr:`ranks` (one per client)."""
        self.max_rank = min(layer.rank for layer in self.layers.values())
        self.ranks = assign_ranks(self.client_ranks, num_clients, self.max_rank, self.rank_levels, self.seed)
        self.factor_keys = {k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)}

    def truncate(self, state: StateDict, rank: int) -> StateDict:
        """``state`` with each layer's ``A`` cut to its first ``rank`` rows and ``B`` to its first ``rank`` columns (a
        factor already of that rank is the same tensor: at full rank a plan carries the global one)."""
        out = dict(state)
        for layer in self.layers.values():
            if layer.a_key in out and out[layer.a_key].shape[0] > rank:
                out[layer.a_key] = out[layer.a_key][:rank].clone()
            if layer.b_key in out and out[layer.b_key].shape[1] > rank:
                out[layer.b_key] = out[layer.b_key][:, :rank].clone()
        return out

    def pad(self, state: StateDict) -> StateDict:
        """``state`` with each layer's factors zero-padded to the adapter's rank."""
        out = dict(state)
        for layer in self.layers.values():
            r = layer.rank
            if layer.a_key in out and out[layer.a_key].shape[0] < r:
                a = out[layer.a_key]
                out[layer.a_key] = torch.cat([a, a.new_zeros(r - a.shape[0], a.shape[1])], 0)
            if layer.b_key in out and out[layer.b_key].shape[1] < r:
                b = out[layer.b_key]
                out[layer.b_key] = torch.cat([b, b.new_zeros(b.shape[0], r - b.shape[1])], 1)
        return out

    def open_client(self, plan: Any) -> None:
        """Client side: zero-pad the received rank-``r_k`` factors to the shared adapter's rank, into ``plan.local``
        (loaded over ``plan.state``): ``plan.state`` stays as it arrived, the reference a compressed upload is
        quantised against on the client and read back against on the server (``federation.compression.upload``)."""
        padded = self.pad(plan.state)
        plan.local = {**plan.local, **{k: v for k, v in padded.items() if v is not plan.state[k]}}

    def client_upload(self, plan: Any, trained: StateDict, steps: int) -> StateDict:
        """Send only the client's rank-``r_k`` factors (and the other trained keys of the plan)."""
        return self.truncate({k: trained[k] for k in plan.state}, self.ranks[plan.client_id])
