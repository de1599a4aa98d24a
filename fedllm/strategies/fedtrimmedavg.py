"""Trimmed-mean aggregation (Yin et al., 2018, "Byzantine-Robust Distributed Learning: Towards Optimal
Statistical Rates")."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientUpdate, Strategy
from fedllm.strategies.fedmedian import checked, stacked


@register_strategy("fedtrimmedavg")
class FedTrimmedAvg(Strategy):
    """FedTrimmedAvg: per coordinate, drop the ``⌊β·n⌋`` largest and smallest client values and average the rest.

    Unweighted, as Flower's ``FedTrimmedAvg`` (equal to it on the same uploads).

    Args:
        beta: fraction cut off each tail, in ``[0, 0.5)`` (Flower: 0.2).
    """

    name = "fedtrimmedavg"
    aggregates_by_sum = False
    needs_individual_updates = "sorts each coordinate of the individual uploads to trim the extremes"
    client_batching = True

    def __init__(self, beta: float = 0.2, **kwargs):
        super().__init__(**kwargs)
        self.beta = float(beta)

    @classmethod
    def check_values(cls, args):
        beta = args.get("beta", 0.2)
        if isinstance(beta, (int, float)) and not isinstance(beta, bool) and not 0 <= beta < 0.5:
            return [("beta", beta, "a number in [0, 0.5)")]
        return []

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        checked(updates)
        n = len(updates)
        cut = int(self.beta * n)
        return {k: stacked(updates, k).sort(dim=0).values[cut:n - cut].mean(dim=0).to(v.dtype)
                for k, v in updates[0].state.items()}
