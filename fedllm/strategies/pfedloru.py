"""pFedLoRU: personalized federated low-rank updates (seed 003, App. C.2, Alg. 2).

Every LoRA-wrapped layer computes ``W + s·B A + s_p·L U``: the global adapter ``(A, B)`` (PEFT's
``default``, aggregated and accumulated exactly as in FedLoRU) and a private adapter ``(L, U)`` per
client (``L``: out × r_p, zero at start; ``U``: r_p × in, random; ``s_p = personal_alpha / personal_r``).
Each round a sampled client first trains ``(L, U)`` for ``personal_steps`` steps with ``(A, B)``
frozen (Eq. 80), then ``(A, B)`` for ``global_steps`` steps with ``(L, U)`` frozen (Eq. 81), and
sends only ``(A, B)``. The private factors are per-client state (DESIGN.md §3): they live in the
client store (checkpointed in ``clients.safetensors``), reach the client through
``ClientPlan.client_state`` and ``ClientPlan.local`` (neither sent nor cast to the wire dtype), and
``personal_state(k, entry)`` is what client ``k`` loads for its personal model ``W + s·B A + s_p·L_k U_k``.

The private factors are parameters ``<layer>.pfedloru.L`` / ``.U`` attached to each PEFT LoRA layer
(frozen outside a client's personal phase), added to the layer's output by a forward hook; between
clients and for the global model they are zero.
"""

from __future__ import annotations

from typing import Optional

import torch

from fedllm.common.errors import InputError
from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, Phase
from fedllm.strategies.fedloru import FedLoRU
from fedllm.strategies.private_adapter import PrivateFactors

MODULE = "pfedloru"


@register_strategy("pfedloru")
class PFedLoRU(PrivateFactors, FedLoRU):
    """pFedLoRU (seed 003, Alg. 2): ``E_per`` steps on private ``(L_k, U_k)``, then ``E_global`` on ``(A, B)``; only ``(A, B)`` is averaged and accumulated as in FedLoRU.

    Args:
        personal_r: rank ``r_p`` of every client's private adapter.
        personal_alpha: its alpha; scaling ``s_p = personal_alpha / personal_r``.
        personal_steps: ``E_per`` optimizer steps on ``(L, U)`` per round (default: ``train.local_steps``
            or ``local_epochs``); 0 skips the personal phase.
        global_steps: ``E_global`` steps on ``(A, B)`` per round (default: ``train.local_steps`` or
            ``local_epochs``).
        weighting, tau, reinit, accumulate, residual: as FedLoRU.
    """

    name = "pfedloru"
    personalized = True
    private_attr = MODULE

    def __init__(self, personal_r: int = 8, personal_alpha: float = 16.0, personal_steps: Optional[int] = None,
                 global_steps: Optional[int] = None, weighting: str = "examples", tau: int = 10,
                 reinit: str = "random", accumulate: str = "merge", residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, tau=tau, reinit=reinit, accumulate=accumulate, residual=residual,
                         **kwargs)
        self.personal_r, self.personal_alpha = personal_r, personal_alpha
        self.personal_steps, self.global_steps = personal_steps, global_steps

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        r = args.get("personal_r", 1)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            problems.append(("personal_r", r, "an integer >= 1"))
        if not args.get("personal_alpha", 1.0) > 0:
            problems.append(("personal_alpha", args["personal_alpha"], "a positive number"))
        for key in ("personal_steps", "global_steps"):
            v = args.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                problems.append((key, v, "an integer >= 0 (or null: train.local_steps)"))
        if args.get("global_steps") == 0:
            problems.append(("global_steps", 0, "an integer >= 1: (A, B) must train"))
        return problems

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        super().setup(model, clients)
        for name, layer in self.layers.items():
            if self.personal_r > min(layer.shape):
                raise InputError(f"personal_r={self.personal_r} exceeds min(out, in) of {name} {layer.shape}")
        self.attach_private(model, self.layers, {n: self.personal_r for n in self.layers},
                            {n: self.personal_alpha / self.personal_r for n in self.layers})

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        phases = []
        if self.personal_steps != 0:
            phases.append(Phase(keys=list(self.private_keys), steps=self.personal_steps, name="personal"))
        phases.append(Phase(keys=list(global_state), steps=self.global_steps, name="global"))
        return ClientPlan(client_id=client_id, rnd=rnd, state=global_state, phases=phases)

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        self.clear_private()
        return super().after_aggregate(rnd, model, global_state)

    def load_state_dict(self, state: StateDict) -> None:
        super().load_state_dict(state)
        self.clear_private()
