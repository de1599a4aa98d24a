"""FedAdagrad (Reddi et al., 2021, Alg. 2) with Flower's defaults."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.strategies.fedopt import ServerOptimizer


@register_strategy("fedadagrad")
class FedAdagrad(ServerOptimizer):
    """FedAdagrad: ``m ← β1·m + (1−β1)·Δ; v ← v + Δ²; θ ← θ + η·m / (√v + τ)``, ``Δ = θ̄ − θ``.

    Args:
        eta: server learning rate η (Flower: 0.1).
        beta_1: first-moment decay (Flower fixes it at 0, so ``m = Δ``; the paper allows β1 > 0).
        tau: adaptivity τ (Flower: 1e-3).
        weighting: ``examples`` or ``uniform`` weights of the mean θ̄.
    """

    name = "fedadagrad"
    buffered_async = True  # federation.mode: async (FedBuff): the step on the buffered mean change

    def __init__(self, eta: float = 0.1, beta_1: float = 0.0, tau: float = 1e-3, weighting: str = "examples",
                 **kwargs):
        super().__init__(eta=eta, beta_1=beta_1, tau=tau, weighting=weighting, **kwargs)

    def server_step(self, rnd, delta):
        m = self.first_moment(delta)
        v = self.moment("v", delta)
        self.moments["v"] = v = {k: v[k] + delta[k] ** 2 for k in delta}
        return self.adaptive_step(self.eta, m, v)
