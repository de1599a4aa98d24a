"""FedSA-LoRA: selective aggregation, ``A`` shared and ``B`` private (Guo et al., ICLR 2025).

Every client trains both LoRA factors; only ``A`` (and the other trainable keys, e.g. RoBERTa's classifier
head) is uploaded and averaged, while each client's ``B`` stays with it. ``B_k`` is per-client state
(DESIGN.md §3): it lives in the client store (checkpointed in ``clients.safetensors``), reaches the client
through ``ClientPlan.client_state`` / ``ClientPlan.local`` (never downloaded, never uploaded) and starts at
zero (LoRA's init). Client ``k``'s personal model is ``W + s·B_k Ā`` (:meth:`FedSALoRA.personal_state`); the
global model keeps ``B = 0`` (no client's ``B`` ever reaches the server).

DoRA (``lora.use_dora``): each layer computes ``m ⊙ (W + s·B·A) / ‖W + s·B·A‖_c``. The magnitude ``m`` is kept
private beside ``B``: it scales the layer's output rows, the side of the client-specific ``B``, as VeRA's output
scaling vector ``λ_b`` does, which the paper's FedSA-VeRA keeps local while sharing ``λ_d`` (the authors' code:
``personalization.local_param: ['vera_lambda_b', ...]`` for VeRA, ``['lora_B', ...]`` for LoRA). Client ``k``'s
model is ``m_k ⊙ (W + s·B_k Ā) / ‖·‖_c``; the global model keeps ``B = 0`` and the initial ``m = ‖W‖_c``, i.e. the
base model, as without DoRA.
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import adapter_layers


@register_strategy("fedsa_lora")
class FedSALoRA(FedAvg):
    """FedSA-LoRA (Guo et al., ICLR 2025): ``Ā = Σ_k p_k A_k`` is shared, ``B_k`` stays private on client ``k``.

    Args:
        weighting: ``examples`` (``p_k = n_k / n``) or ``uniform``.
    """

    name = "fedsa_lora"
    late_update = ("dropped: its private B_k stays as before the round and Ā is the mean of the arrived clients' A_k; "
                   "its next round starts from the new Ā")
    aggregates_by_sum = True  # FedAvg's weighted mean of the shared keys
    personalized = True

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        names = {id(p): n for n, p in model.named_parameters()}
        self.initial_private = {layer.b_key: torch.zeros_like(layer.module.lora_B["default"].weight)
                          for layer in self.layers.values()}
        for layer in self.layers.values():  # DoRA: the magnitude is private too, from its init ‖W‖_c
            if "default" in layer.module.lora_magnitude_vector:
                m = layer.module.lora_magnitude_vector["default"].weight
                self.initial_private[names[id(m)]] = m.detach().clone()
        self.private_keys = list(self.initial_private)

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        shared = {k: v for k, v in global_state.items() if k not in self.initial_private}
        return ClientPlan(client_id, rnd, shared, [Phase(keys=list(shared) + self.private_keys)])

    def personal_state(self, client_id: int, client_state: StateDict) -> StateDict | None:
        """Client ``client_id``'s private ``B`` (and DoRA magnitude) of every layer (their init if it never trained)."""
        return {k: (client_state[k].to(v.device, copy=True) if k in client_state else v.clone())
                for k, v in self.initial_private.items()}

    def open_client(self, plan: ClientPlan) -> None:
        """Load the client's own ``B`` beside the received shared keys."""
        plan.local = self.personal_state(plan.client_id, plan.client_state)

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Keep the trained ``B`` (and DoRA magnitude) on the client (the upload holds only the shared keys)."""
        return {k: trained[k] for k in self.private_keys}

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        return {**global_state, **super().aggregate(rnd, global_state, updates)}
