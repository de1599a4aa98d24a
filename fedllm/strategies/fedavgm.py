"""FedAvgM (Hsu et al., 2019): FedAvg with server momentum, as Flower's ``FedAvgM``."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.fedopt import ServerOptimizer


@register_strategy("fedavgm")
class FedAvgM(ServerOptimizer):
    """FedAvgM: ``v ← β·v + Δ; θ ← θ + η·v`` with ``Δ = θ̄ − θ_sent`` (the negated pseudo-gradient of Flower).

    With Flower's defaults (``server_learning_rate: 1``, ``server_momentum: 0``) there is no server
    optimisation and the result is FedAvg's mean, bit for bit (under a compressed download too: the mean of
    uploads that started from the dequantised download, as FedAvg's).

    Args:
        server_learning_rate: server learning rate η (Flower: 1.0).
        server_momentum: momentum β (Flower: 0.0).
        weighting: ``examples`` or ``uniform`` weights of the mean θ̄.
    """

    name = "fedavgm"
    aggregates_by_sum = True  # FedAvg's weighted mean, then server momentum
    buffered_async = True  # federation.mode: async (FedBuff)

    def __init__(self, server_learning_rate: float = 1.0, server_momentum: float = 0.0,
                 weighting: str = "examples", **kwargs):
        super().__init__(eta=server_learning_rate, beta_1=server_momentum, weighting=weighting, **kwargs)

    def server_step(self, rnd, delta):
        v = self.moment("momentum", delta)
        self.moments["momentum"] = v = {k: self.beta_1 * v[k] + delta[k] for k in delta}
        return {k: self.eta * v[k] for k in v}

    def aggregate(self, rnd, global_state, updates):
        if self.eta == 1.0 and self.beta_1 == 0.0:
            return FedAvg.aggregate(self, rnd, global_state, updates)
        return super().aggregate(rnd, global_state, updates)
