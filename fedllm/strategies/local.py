"""Local-only training: the baseline of personalized FL (seed 002 Table 4, seed 004 Tables 1–2)."""

from __future__ import annotations

from typing import Optional

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.loading import read_state
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase, Strategy


@register_strategy("local")
class Local(Strategy):
    """Local training: each client trains its own adapter (and head) from the shared LoRA init, ``θ_k ← train_k(θ_k)``; nothing is sent or aggregated.

    A client's adapter is per-client state (the client store); the global model stays at the
    initial adapter and every client's personal model is its own adapter (``personal_state``).
    """

    name = "local"
    aggregates_by_sum = False
    needs_individual_updates = "aggregates nothing"
    late_update_problem = ("aggregates nothing, so a round has nothing to wait for: a deadline would only throw "
                           "away a client's own training")
    personalized = True

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.keys = [n for n, p in model.named_parameters() if p.requires_grad]
        self.initial = read_state(model, self.keys)

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        return ClientPlan(client_id=client_id, rnd=rnd, state={}, phases=[Phase(keys=list(self.keys))])

    def personal_state(self, client_id: int, client_state: StateDict) -> Optional[StateDict]:
        """Client ``client_id``'s own adapter (the initial one if it never trained)."""
        source = client_state if client_state else self.initial
        return {k: source[k].to(self.initial[k].device, copy=True) for k in self.keys}

    def open_client(self, plan: ClientPlan) -> None:
        plan.local = self.personal_state(plan.client_id, plan.client_state)

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        return {k: trained[k] for k in self.keys}

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        return {}

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        return global_state
