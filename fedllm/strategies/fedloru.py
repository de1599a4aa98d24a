"""FedLoRU: federated low-rank updates with periodic accumulation (seed 003, Alg. 1 and App. C.1, D.2).

In PEFT's notation a layer computes ``W + s·B A`` (``B``: out × r, ``A``: r × in, ``s = alpha / r``); the
paper's ``A_t`` (m × r) is PEFT's ``B`` and its ``B_t`` (r × n) is PEFT's ``A``. Clients continue from the
aggregated ``(A_{t−1}, B_{t−1})``; every ``tau`` rounds the server and every client accumulate
``W ← W + s·B_t A_t`` and the adapter is re-initialised so that its product is zero again: the model's
output is unchanged and nothing is counted twice.

Re-initialisation after an accumulation (D.2; ``reinit``):

- ``random``: a fresh LoRA init (``A`` random, ``B = 0``, seeded so all clients agree); the product is
  zero again, so the merged update is counted once.
- ``momentum`` (this library's reading, the default of the ``momentum`` name): keep the learned ``A`` and
  zero ``B``. The product restarts at zero (nothing counted twice, outputs unchanged by the accumulation)
  while ``A`` keeps its learned subspace. This *departs from the paper's text*, which says the momentum
  variant "retain[s] the existing weights of the matrices, continuing to use the previous low-rank update
  matrices": kept literally, the merged product would stay in the adapter too.
- ``momentum_literal`` (the paper's text): keep both ``A`` and ``B``. The accumulation still adds
  ``s·B_t A_t`` to ``W`` (Alg. 1), so right after it the model computes ``W + 2·s·B_t A_t``: the
  accumulated product is counted twice (once in ``W``, once in the continuing adapter), the model's
  output jumps at every accumulation, and the next accumulation merges the whole product again,
  carried part included. Offered to reproduce the paper as written; ``momentum`` is the variant whose
  accumulation leaves the model's function unchanged.

Optimizer moments (``train.optimizer_state: per_client``) follow the one rule of all merge-and-reinit
strategies (:func:`~fedllm.strategies.residual.drop_moments`): the moments of re-initialised factors are
dropped the next time each client trains (``random``: ``A`` and ``B``; ``momentum``: ``B``;
``momentum_literal``: none), see :meth:`FedLoRU.client_optimizer_state`.

Accumulation (``accumulate``): ``merge`` adds the product into the base weights (Alg. 1; with a 4/8-bit or
half-precision base the sum is kept as an fp32 dense residual beside it, see ``residual``); ``keep`` is
the fine-tuning variant (C.1): the frozen base is never touched and the accumulated factors are kept
beside it, plug-and-play, computed in the forward pass by hooks on the LoRA layers. In both modes every
accumulated ``(B_t, A_t, s)`` is recorded and returned by :meth:`FedLoRU.kept_factors`, so the learned
change of a layer relative to the pretrained weight is ``Σ_t s·B_t A_t + s·B A`` (the current adapter);
in ``merge`` mode these pieces are also inside the base already (``kept_in_base``).
"""

from __future__ import annotations

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.state import DTYPES, StateDict
from fedllm.runs.base_history import LowRankMerge
from fedllm.strategies.base import ClientInfo, ClientUpdate
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import (
    RESIDUAL_MODES,
    BaseUpdates,
    KeptFactors,
    adapter_layers,
    drop_moments,
    layer_seed,
    recipe_value,
    resolve_residual_mode,
    standard_factors,
    to_wire,
)

REINIT_MODES = ("random", "momentum", "momentum_literal")
ACCUMULATE_MODES = ("merge", "keep")


@register_strategy("fedloru")
class FedLoRU(FedAvg):
    """FedLoRU (seed 003, Alg. 1): ``(A, B) ← Σ_k p_k (A_k, B_k)``; every ``tau`` rounds ``W ← W + s·B A`` and the adapter restarts with ``B A = 0``.

    Args:
        weighting: ``examples`` (``p_k = n_k / n``) or ``uniform``.
        tau: accumulation cycle τ in rounds (a τ above the number of rounds is FedAvg with LoRA).
        reinit: ``random`` (fresh LoRA init), ``momentum`` (keep ``A`` and its moments, ``B = 0``) or
            ``momentum_literal`` (keep ``A`` and ``B``: the paper's D.2 as written; the merged product is
            then counted twice, see the module docstring).
        accumulate: ``merge`` (into the base, Alg. 1) or ``keep`` (beside the frozen base, C.1).
        residual: how a merge reaches the base: ``auto``, ``merge`` (in place) or ``dense`` (fp32 residual).
    """

    name = "fedloru"
    aggregates_by_sum = True  # FedAvg's weighted mean (and which clients trained: their ids are public)
    kept_in_base = False  # set per run in setup: True with accumulate="merge"

    def __init__(self, weighting: str = "examples", tau: int = 10, reinit: str = "random", accumulate: str = "merge",
                 residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.tau, self.reinit, self.accumulate, self.residual = tau, reinit, accumulate, residual

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        tau = args.get("tau", 1)
        if not isinstance(tau, int) or isinstance(tau, bool) or tau < 1:
            problems.append(("tau", tau, "an integer >= 1"))
        for key, allowed in (("reinit", REINIT_MODES), ("accumulate", ACCUMULATE_MODES), ("residual", RESIDUAL_MODES)):
            if key in args and args[key] not in allowed:
                problems.append((key, args[key], f"one of {', '.join(allowed)}"))
        return problems

    def accumulates(self, rnd: int) -> bool:
        """True when round ``rnd`` ends with an accumulation."""
        return rnd % self.tau == 0

    # ----- hooks
    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.num_clients = len(clients)
        merge = self.accumulate == "merge"
        self.base = BaseUpdates(self.layers, resolve_residual_mode(self.residual, self.layers)) if merge else None
        self.kept = KeptFactors(self.layers, live=not merge)
        self.modifies_base = bool(merge and self.base.modifies_base)
        self.kept_in_base = merge
        self.lora_numel = sum(layer.numel for layer in self.layers.values())
        self.last_round = torch.zeros(len(clients), dtype=torch.int64)  # round each client last trained (0: never)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        for u in updates:
            self.last_round[u.client_id] = rnd
        return super().aggregate(rnd, global_state, updates)

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        if not self.accumulates(rnd):
            return global_state
        out = dict(global_state)
        for name, layer in self.layers.items():
            b = global_state[layer.b_key].to(DTYPES[self.comm_dtype])  # what every client receives
            a = global_state[layer.a_key].to(DTYPES[self.comm_dtype])
            self.kept.append(name, b, a, layer.scale)
            if self.base is not None:
                self.base.add(name, LowRankMerge([(b, a, layer.scale)]), rnd)
            if self.reinit == "momentum_literal":
                continue
            if self.reinit == "random":
                _, a_new = standard_factors(layer, recipe_value(self.recipe, "lora.init", "default"),
                                            layer_seed(self.seed, name, 0xACC, rnd))
                out[layer.a_key] = to_wire(a_new, self.comm_dtype, global_state[layer.a_key])
            out[layer.b_key] = torch.zeros_like(global_state[layer.b_key])
        return out

    def reinitialised_keys(self) -> list[str]:
        """State keys whose values (and optimiser moments) an accumulation resets."""
        if self.reinit == "momentum_literal":
            return []
        keys = [layer.b_key for layer in self.layers.values()]
        if self.reinit == "random":
            keys += [layer.a_key for layer in self.layers.values()]
        return keys

    def reinitialised_at(self, rnd: int) -> list[str]:
        """The factors an accumulation re-initialises: their download residual restarts with them (the merge itself
        travels to every client uncompressed, as :meth:`extra_download_bytes` counts it)."""
        return self.reinitialised_keys() if self.accumulates(rnd) else []

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """Drop the moments of factors re-initialised since the client last trained (``drop_moments``)."""
        if not state:
            return state
        last = int(self.last_round[client_id])
        if not any(self.accumulates(t) for t in range(max(last, 1), rnd)):
            return state
        return drop_moments(state, self.reinitialised_keys())

    def extra_download_bytes(self, rnd: int, sampled: list[int], num_clients: int, comm_dtype: str) -> dict[int, int]:
        """At an accumulation every client receives ``(A_t, B_t)`` to update its copy of ``W`` (Alg. 1)."""
        if not self.accumulates(rnd):
            return {}
        return {c: self.lora_numel * DTYPES[comm_dtype].itemsize for c in range(num_clients)}

    def kept_factors(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        return self.kept.as_dict()

    def base_residuals(self) -> dict[str, torch.Tensor]:
        return dict(self.base.residual) if self.base is not None else {}

    def state_dict(self) -> StateDict:
        state = self.kept.state_dict()
        if self.base is not None:
            state.update(self.base.state_dict())
        state["last_round"] = self.last_round.clone()
        return state

    def load_state_dict(self, state: StateDict) -> None:
        self.kept.load_state_dict(state)
        if self.base is not None:
            self.base.load_state_dict(state)
        if "last_round" in state:
            self.last_round = state["last_round"].clone()
