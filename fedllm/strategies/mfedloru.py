"""mFedLoRU: model-heterogeneous federated low-rank updates (seed 003, App. C.3, Alg. 3).

Client ``k`` has its own rank ``r_k``. A client with ``r_k ≥ r`` (the global LoRA rank) trains the
adapter directly, as in FedLoRU. A client with ``r_k < r`` keeps the received ``(A, B)`` frozen and
trains nested factors that update them (Eq. 82, in PEFT's orientation)::

    B_k = B + α_n · Bd Bu        Bd: out × r_k (zero at start), Bu: r_k × r (random)
    A_k = A + α_n · Ad Au        Ad: r × r_k  (zero at start), Au: r_k × in (random)

so the nested products start at zero and the client's first forward pass is the global model's. The
client draws them itself (``ClientPlan.local``: not downloaded) and sends ``(Bd, Bu, Ad, Au)``; the
server rebuilds the rank-``r`` ``(A_k, B_k)`` from the ``(A, B)`` it sent and averages them (then
accumulates every ``tau`` rounds exactly as FedLoRU).

The nested factors are parameters ``<layer>.mfedloru.{a_down,a_up,b_down,b_up}`` attached to each
PEFT LoRA layer, sized for the largest nested rank (a smaller rank leaves the extra rows and columns
at zero on both sides, where they get no gradient and stay zero); forward hooks on the layer's
``lora_A`` / ``lora_B`` modules add the nested products, so ``s·B_k A_k x`` is computed exactly.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from fedllm.common.errors import InputError
from fedllm.common.registry import register_strategy
from fedllm.models.lowrank import lora_init_
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase
from fedllm.strategies.fedloru import FedLoRU
from fedllm.strategies.residual import layer_seed, recipe_value

MODULE = "mfedloru"
PARTS = ("a_down", "a_up", "b_down", "b_up")


class NestedFactors(torch.nn.Module):
    """Nested updates of one layer's LoRA factors, padded to rank ``R``: ``A + s·a_down a_up``, ``B + s·b_down b_up``."""

    def __init__(self, in_features: int, out_features: int, r: int, nested_rank: int, scale: float, device: Any = None):
        super().__init__()
        self.scale = scale

        def zeros(*shape):
            return torch.nn.Parameter(torch.zeros(*shape, device=device), requires_grad=False)

        self.a_down, self.a_up = zeros(r, nested_rank), zeros(nested_rank, in_features)
        self.b_down, self.b_up = zeros(out_features, nested_rank), zeros(nested_rank, r)


def _nested_hook(nested: NestedFactors, which: str):
    def add_nested(module: Any, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        down, up = getattr(nested, f"{which}_down"), getattr(nested, f"{which}_up")
        x = args[0].to(up.dtype)
        return output + (F.linear(F.linear(x, up), down) * nested.scale).to(output.dtype)

    return add_nested


@register_strategy("mfedloru")
class MFedLoRU(FedLoRU):
    """mFedLoRU (seed 003, Alg. 3): client ``k`` trains ``A_k = A + α·Ad Au``, ``B_k = B + α·Bd Bu`` of rank ``r_k``; the server rebuilds and averages ``(A_k, B_k)``, accumulating as FedLoRU.

    Args:
        client_ranks: rank ``r_k`` of every client (a list of ``federation.num_clients`` integers);
            ``r_k ≥ lora.r`` trains the adapter itself. Default: every client at ``lora.r`` (FedLoRU).
        nested_scale: ``α_A = α_B`` multiplying the nested products (D.2 sets ``α/r_k = 1/2``, read as
            LoRA's ``alpha / rank`` scaling: 0.5).
        weighting, tau, reinit, accumulate, residual: as FedLoRU.
    """

    name = "mfedloru"
    aggregates_by_sum = False
    needs_individual_updates = "rebuilds each client's factors from its nested products before averaging"

    def __init__(self, client_ranks: Optional[list] = None, nested_scale: float = 0.5, weighting: str = "examples",
                 tau: int = 10, reinit: str = "random", accumulate: str = "merge", residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, tau=tau, reinit=reinit, accumulate=accumulate, residual=residual,
                         **kwargs)
        self.client_ranks, self.nested_scale = client_ranks, nested_scale

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        ranks = args.get("client_ranks")
        if ranks is not None and (not isinstance(ranks, list) or not ranks or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks)):
            problems.append(("client_ranks", ranks, "a list of positive integers, one per client"))
        if not args.get("nested_scale", 1.0) > 0:
            problems.append(("nested_scale", args["nested_scale"], "a positive number"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        super().setup(model, clients)
        r = min(layer.rank for layer in self.layers.values())
        ranks = self.client_ranks if self.client_ranks is not None else [r] * len(clients)
        if len(ranks) != len(clients):
            raise InputError(f"federation.strategy_args.client_ranks: got {len(ranks)} ranks for {len(clients)} "
                             "clients; expected one per client")
        self.ranks = [int(x) for x in ranks]
        self.nested_rank = max([x for x in self.ranks if x < r], default=0)
        self.nested_keys: list[str] = []
        self.zero_nested: StateDict = {}
        if not self.nested_rank:
            return
        for name, layer in self.layers.items():
            device = layer.module.lora_A["default"].weight.device
            nested = NestedFactors(layer.shape[1], layer.shape[0], layer.rank, self.nested_rank, self.nested_scale,
                                   device)
            layer.module.add_module(MODULE, nested)
            layer.module.lora_A["default"].register_forward_hook(_nested_hook(nested, "a"))
            layer.module.lora_B["default"].register_forward_hook(_nested_hook(nested, "b"))
            for part in PARTS:
                key = f"{name}.{MODULE}.{part}"
                self.nested_keys.append(key)
                self.zero_nested[key] = torch.zeros_like(getattr(nested, part))

    def nested(self, client_id: int) -> bool:
        """True when the client trains nested factors (its rank is below the adapter's)."""
        return self.ranks[client_id] < min(layer.rank for layer in self.layers.values())

    def _initial_nested(self, rnd: int, client_id: int) -> StateDict:
        """Fresh nested factors of rank ``r_k`` (down zero, up random; zero padding beyond ``r_k``)."""
        rank, state = self.ranks[client_id], {}
        init = recipe_value(self.recipe, "lora.init", "default")
        for name, layer in self.layers.items():
            gen = torch.Generator().manual_seed(layer_seed(self.seed, name, 0x3E57, rnd, client_id))
            for which, inner in (("a", layer.shape[1]), ("b", layer.rank)):
                down = self.zero_nested[f"{name}.{MODULE}.{which}_down"].clone()
                up = self.zero_nested[f"{name}.{MODULE}.{which}_up"].clone()
                drawn = torch.empty(rank, inner)
                lora_init_(drawn, torch.empty(down.shape[0], rank), init, gen)
                up[:rank] = drawn.to(up.device)
                state[f"{name}.{MODULE}.{which}_down"], state[f"{name}.{MODULE}.{which}_up"] = down, up
        return state

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        if not self.nested(client_id):
            return ClientPlan(client_id, rnd, global_state, [Phase(keys=list(global_state))],
                              local=dict(self.zero_nested))
        factor_keys = {k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)}
        head = [k for k in global_state if k not in factor_keys]
        return ClientPlan(client_id, rnd, global_state, [Phase(keys=self.nested_keys + head, name="nested")],
                          local=self._initial_nested(rnd, client_id))

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Nested clients send their rank-``r_k`` factors (and the head); full-rank clients send ``(A, B)``."""
        if not self.nested(plan.client_id):
            return {k: trained[k] for k in plan.state}
        rank = self.ranks[plan.client_id]
        out = {k: trained[k] for k in plan.state if self._is_head(k)}
        for name in self.layers:
            for part in PARTS:
                key = f"{name}.{MODULE}.{part}"
                value = trained[key]
                out[key] = (value[:, :rank] if part.endswith("down") else value[:rank]).clone()
        return out

    def _is_head(self, key: str) -> bool:
        return not any(key in (layer.a_key, layer.b_key) for layer in self.layers.values())

    def rebuild(self, global_state: StateDict, update: ClientUpdate) -> ClientUpdate:
        """A nested client's rank-``r`` ``(A_k, B_k)`` from the ``(A, B)`` it received and its nested factors."""
        if not self.nested(update.client_id):
            return update
        sent = {k: v.float() for k, v in self.received(global_state).items()}  # comm_dtype or dequantised download
        state = {k: v for k, v in update.state.items() if MODULE not in k}
        for name, layer in self.layers.items():
            part = {p: update.state[f"{name}.{MODULE}.{p}"].to(sent[layer.a_key].device, torch.float32) for p in PARTS}
            a = sent[layer.a_key] + self.nested_scale * (part["a_down"] @ part["a_up"])
            b = sent[layer.b_key] + self.nested_scale * (part["b_down"] @ part["b_up"])
            state[layer.a_key] = a.to(global_state[layer.a_key].dtype)
            state[layer.b_key] = b.to(global_state[layer.b_key].dtype)
        return ClientUpdate(update.client_id, state, update.num_examples, update.loss, update.steps)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        return super().aggregate(rnd, global_state, [self.rebuild(global_state, u) for u in updates])

    @torch.no_grad()
    def clear_nested(self) -> None:
        """Zero the nested factors in the model (the global model has none)."""
        for layer in self.layers.values():
            if hasattr(layer.module, MODULE):
                for part in PARTS:
                    getattr(getattr(layer.module, MODULE), part).zero_()

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        self.clear_nested()
        return super().after_aggregate(rnd, model, global_state)

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """Nested factors start afresh every round: their moments never carry over."""
        state = super().client_optimizer_state(rnd, client_id, state)
        if not state:
            return state
        nested = set(self.nested_keys)
        return {k: v for k, v in state.items() if k.split("::", 1)[0] not in nested}

    def load_state_dict(self, state: StateDict) -> None:
        super().load_state_dict(state)
        self.clear_nested()
