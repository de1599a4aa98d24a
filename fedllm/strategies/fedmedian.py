"""FedMedian (Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates")."""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict, check_same_keys
from fedllm.strategies.base import ClientUpdate, Strategy


def stacked(updates: list[ClientUpdate], key: str) -> torch.Tensor:
    """The clients' values of ``key`` stacked along a new first axis, in fp64."""
    return torch.stack([u.state[key].double() for u in updates])


def coordinate_median(stack: torch.Tensor) -> torch.Tensor:
    """Coordinate-wise median over the first axis; the mean of the two middle values for an even count
    (``numpy.median``; ``torch.median`` would take the lower one)."""
    ordered = stack.sort(dim=0).values
    n = stack.shape[0]
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def checked(updates: list[ClientUpdate]) -> None:
    """Every update has the keys of the first (robust rules compare clients key by key)."""
    if not updates:
        raise ValueError("no client updates to aggregate")
    for u in updates[1:]:
        check_same_keys(updates[0].state, u.state, "client updates")


@register_strategy("fedmedian")
class FedMedian(Strategy):
    """FedMedian: ``θ ← median_k θ_k`` coordinate by coordinate over every uploaded tensor (unweighted).

    Equal to Flower's ``FedMedian`` on the same uploads.
    """

    name = "fedmedian"
    aggregates_by_sum = False
    needs_individual_updates = "takes the coordinate-wise median of the individual uploads"
    client_batching = True  # client side is the base's

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        checked(updates)
        return {k: coordinate_median(stacked(updates, k)).to(v.dtype) for k, v in updates[0].state.items()}
