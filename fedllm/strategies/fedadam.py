"""FedAdam (Reddi et al., 2021, Alg. 2) with Flower's defaults and bias correction."""

from __future__ import annotations

import math

from fedllm.common.registry import register_strategy
from fedllm.strategies.fedopt import ServerOptimizer


@register_strategy("fedadam")
class FedAdam(ServerOptimizer):
    """FedAdam: ``m ← β1·m + (1−β1)·Δ; v ← β2·v + (1−β2)·Δ²; θ ← θ + η_t·m / (√v + τ)``, ``Δ = θ̄ − θ``.

    ``η_t = η·√(1 − β2^(t+1)) / (1 − β1^(t+1))`` in round ``t`` (1-based), Flower's bias correction.

    Args:
        eta: server learning rate η (Flower: 0.1).
        beta_1: first-moment decay (Flower: 0.9).
        beta_2: second-moment decay (Flower: 0.99).
        tau: adaptivity τ (Flower: 1e-3).
        weighting: ``examples`` or ``uniform`` weights of the mean θ̄.
    """

    name = "fedadam"
    buffered_async = True  # federation.mode: async (FedBuff): the step on the buffered mean change

    def __init__(self, eta: float = 0.1, beta_1: float = 0.9, beta_2: float = 0.99, tau: float = 1e-3,
                 weighting: str = "examples", **kwargs):
        super().__init__(eta=eta, beta_1=beta_1, beta_2=beta_2, tau=tau, weighting=weighting, **kwargs)

    def server_step(self, rnd, delta):
        m = self.first_moment(delta)
        v = self.moment("v", delta)
        self.moments["v"] = v = {k: self.beta_2 * v[k] + (1 - self.beta_2) * delta[k] ** 2 for k in delta}
        eta = self.eta * math.sqrt(1 - self.beta_2 ** (rnd + 1.0)) / (1 - self.beta_1 ** (rnd + 1.0))
        return self.adaptive_step(eta, m, v)
