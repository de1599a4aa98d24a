"""A private low-rank adapter per client on every LoRA-wrapped layer (pFedLoRU's ``(L, U)``, FedLoRA's ``τ``).

Each layer gets a :class:`PrivateAdapter` submodule (parameters ``<layer>.<attr>.L`` / ``.U``) whose
product ``s_p · L @ U`` a forward hook adds to the layer's output. The factors hold a client's values
only while that client trains or while its personal model is loaded; the global model has them at
zero. Their values between rounds are per-client state (DESIGN.md §3): :class:`PrivateFactors`
reads them from ``ClientPlan.client_state`` into ``ClientPlan.local`` (neither sent nor cast to the
wire dtype) and gives them back to the client store in ``close_client``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from fedllm.models.lowrank import lora_init_
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientPlan
from fedllm.strategies.residual import AdapterLayer, layer_seed


class PrivateAdapter(torch.nn.Module):
    """A client's private factors of one layer: ``s_p · L @ U`` (``L``: out × r_p, ``U``: r_p × in)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scale: float, device: Any = None):
        super().__init__()
        self.scale = scale
        self.U = torch.nn.Parameter(torch.zeros(rank, in_features, device=device), requires_grad=False)
        self.L = torch.nn.Parameter(torch.zeros(out_features, rank, device=device), requires_grad=False)


def _private_hook(attr: str):
    def add_private(module: Any, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        private: PrivateAdapter = getattr(module, attr)
        if module.disable_adapters or module.merged:
            return None
        x = module.lora_dropout["default"](args[0].to(private.U.dtype))
        return output + (F.linear(F.linear(x, private.U), private.L) * private.scale).to(output.dtype)

    return add_private


class PrivateFactors:
    """Mixin of a :class:`~fedllm.strategies.base.Strategy`: private factors per client, kept in the client store.

    Class attributes:
        private_attr: submodule name of the adapter on each layer (part of the state keys).
        private_salt: seed salt of the clients' initial factors.
    """

    private_attr = "private"
    async_refusal = ("keeps personalised per-client factors trained against the shared ones of its round (FedBuff "
                     "is defined for FedAvg and FedOpt, whose clients keep no personal state)")
    late_update = ("dropped: its private factors stay as before the round (its store entry is not replaced) and the "
                   "shared part is aggregated from the clients that arrived; its next round starts from that")
    private_salt = 0x9E7

    def attach_private(self, model: torch.nn.Module, layers: dict[str, AdapterLayer],
                       ranks: dict[str, int], scales: dict[str, float]) -> None:
        """Add a zero private adapter of rank ``ranks[name]`` and scaling ``scales[name]`` to each layer."""
        self.model = model
        self.private_layers = layers
        self.private_keys: list[str] = []
        for name, layer in layers.items():
            device = layer.module.lora_A["default"].weight.device
            layer.module.add_module(self.private_attr, PrivateAdapter(layer.shape[1], layer.shape[0], ranks[name],
                                                                      scales[name], device))
            layer.module.register_forward_hook(_private_hook(self.private_attr))
            self.private_keys += [f"{name}.{self.private_attr}.L", f"{name}.{self.private_attr}.U"]

    def private_init(self) -> str:
        """LoRA init of the private factors: ``default`` or ``gaussian`` (the recipe's ``lora.init``)."""
        from fedllm.strategies.residual import recipe_value

        return recipe_value(self.recipe, "lora.init", "default")

    def _initial_private(self, client_id: int) -> StateDict:
        """Client ``client_id``'s private factors before it first trains: ``U`` random, ``L = 0`` (seeded)."""
        state: StateDict = {}
        init = self.private_init()
        for name, layer in self.private_layers.items():
            private: PrivateAdapter = getattr(layer.module, self.private_attr)
            gen = torch.Generator().manual_seed(layer_seed(self.seed, name, self.private_salt, client_id))
            u, l = torch.empty(private.U.shape), torch.empty(private.L.shape)
            lora_init_(u, l, init, gen)
            state[f"{name}.{self.private_attr}.L"] = l.to(private.L.device)
            state[f"{name}.{self.private_attr}.U"] = u.to(private.U.device)
        return state

    def personal_state(self, client_id: int, client_state: StateDict) -> Optional[StateDict]:
        """Client ``client_id``'s private factors of every layer (its initial ones if it never trained)."""
        if not client_state:
            return self._initial_private(client_id)
        device = next(iter(self.private_layers.values())).module.lora_A["default"].weight.device
        return {k: client_state[k].to(device, copy=True) for k in self.private_keys}

    def open_client(self, plan: ClientPlan) -> None:
        """Load the client's stored private factors (seeded initial ones the first time)."""
        plan.local = self.personal_state(plan.client_id, plan.client_state)

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Keep the trained private factors on the client (the upload holds only the shared keys)."""
        return {k: trained[k] for k in self.private_keys}

    @torch.no_grad()
    def clear_private(self) -> None:
        """Zero the private factors in the model (the global model has none)."""
        for layer in self.private_layers.values():
            private: PrivateAdapter = getattr(layer.module, self.private_attr)
            private.L.zero_()
            private.U.zero_()
