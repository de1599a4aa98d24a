"""FedAvg (McMahan et al., 2017) on LoRA adapters."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict, weighted_mean
from fedllm.strategies.base import ClientUpdate, Strategy


@register_strategy("fedavg")
class FedAvg(Strategy):
    """FedAvg: ``θ ← Σ_k n_k θ_k / Σ_k n_k`` over every trainable tensor (LoRA and classifier head).

    Args:
        weighting: ``examples`` (weights = client example counts) or ``uniform``.
    """

    name = "fedavg"
    client_batching = True  # client side is the base's: one phase, no client hooks
    aggregates_by_sum = True  # a weighted mean
    buffered_async = True  # federation.mode: async (FedBuff)

    def __init__(self, weighting: str = "examples", **kwargs):
        super().__init__(**kwargs)
        self.weighting = weighting

    @classmethod
    def check_values(cls, args):
        w = args.get("weighting", "examples")
        return [] if w in ("examples", "uniform") else [("weighting", w, "'examples' or 'uniform'")]

    def weights(self, updates: list[ClientUpdate]) -> list[float]:
        """Aggregation weight of each update."""
        return [1.0 if self.weighting == "uniform" else float(u.num_examples) for u in updates]

    def sum_weight(self, update: ClientUpdate) -> int:
        return round(self.weights([update])[0])

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        return weighted_mean([u.state for u in updates], self.weights(updates))
