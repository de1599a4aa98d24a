"""FFA-LoRA (Sun et al., ICLR 2024): A frozen at its seed-shared random init, only B trains and travels."""

from __future__ import annotations

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientPlan, ClientUpdate
from fedllm.strategies.fedavg import FedAvg


def is_lora_a(name: str) -> bool:
    """True for a LoRA ``A`` factor (PEFT's ``...lora_A.<adapter>.weight``)."""
    return ".lora_A." in name


@register_strategy("ffa_lora")
class FFALoRA(FedAvg):
    """FFA-LoRA: every ``A`` stays at its init; ``B ← Σ_k n_k B_k / Σ_k n_k`` (and the classifier head, as FedAvg).

    ``A`` is the run-seeded PEFT init, the same on every client (the model is built from the recipe's
    seed), so it is never sent: the plan, the upload and both byte counts hold only the other trainable
    tensors. The global state keeps ``A`` so checkpoints and exports are self-contained.

    Args:
        weighting: ``examples`` or ``uniform``, as FedAvg.
    """

    name = "ffa_lora"
    aggregates_by_sum = True  # FedAvg's weighted mean of B

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        sent = {k: v for k, v in global_state.items() if not is_lora_a(k)}
        return ClientPlan(client_id=client_id, rnd=rnd, state=sent)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        return {**global_state, **super().aggregate(rnd, global_state, updates)}
