"""FedProx (Li et al., 2020): FedAvg with a proximal term in every client's loss."""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.strategies.base import ClientPlan
from fedllm.strategies.fedavg import FedAvg


@register_strategy("fedprox")
class FedProx(FedAvg):
    """FedProx: client loss ``f_k(θ) + (mu/2)·‖θ − θ_global‖²`` over the trainable tensors; FedAvg aggregation.

    ``θ_global`` is the state the client loaded this round (``plan.state``); the term's gradient is
    ``mu·(θ − θ_global)``. It is added to every micro-batch's loss before the division by
    ``grad_accum``, so each optimizer step sees it once.

    Args:
        mu: proximal weight (OpenFedLLM's and the FRLoRA paper's 0.01).
        weighting: ``examples`` or ``uniform``, as FedAvg.
    """

    name = "fedprox"
    client_batching = True  # client_loss reads only model.named_parameters() (fedllm.engine.batched_clients.ClientView)

    def __init__(self, mu: float = 0.01, weighting: str = "examples", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.mu = float(mu)

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        mu = args.get("mu", 0.0)
        if isinstance(mu, (int, float)) and mu < 0:
            problems.append(("mu", mu, "a number >= 0"))
        return problems

    def client_loss(self, model: torch.nn.Module, plan: ClientPlan) -> torch.Tensor | None:
        terms = [(p.float() - plan.state[name].to(p.device, torch.float32)).pow(2).sum()
                 for name, p in model.named_parameters() if p.requires_grad and name in plan.state]
        return 0.5 * self.mu * torch.stack(terms).sum() if terms else None
