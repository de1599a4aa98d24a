"""FedYogi (Reddi et al., 2021, Alg. 2) with Flower's defaults."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.strategies.fedopt import ServerOptimizer


@register_strategy("fedyogi")
class FedYogi(ServerOptimizer):
    """FedYogi: ``m ← β1·m + (1−β1)·Δ; v ← v − (1−β2)·Δ²·sign(v − Δ²); θ ← θ + η·m / (√v + τ)``, ``Δ = θ̄ − θ``.

    Args:
        eta: server learning rate η (Flower: 1e-2).
        beta_1: first-moment decay (Flower: 0.9).
        beta_2: second-moment decay (Flower: 0.99).
        tau: adaptivity τ (Flower: 1e-3).
        weighting: ``examples`` or ``uniform`` weights of the mean θ̄.
    """

    name = "fedyogi"
    buffered_async = True  # federation.mode: async (FedBuff): the step on the buffered mean change

    def __init__(self, eta: float = 1e-2, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 weighting: str = "examples", **kwargs):
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, weighting=weighting, **kwargs)

    def server_step(self, rnd, delta):
        m = self.first_moment(delta)
        v = self.moment("v", delta)
        sq = {k: d ** 2 for k, d in delta.items()}
        self.moments["v"] = v = {k: v[k] - (1 - self.beta_2) * sq[k] * (v[k] - sq[k]).sign() for k in delta}
        return self.adaptive_step(self.eta, m, v)
