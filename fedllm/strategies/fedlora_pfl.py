"""FedLoRA for personalized FL (seed 002, Alg. 1; seed 003 App. C.4 pFedLoRA(1)/(2)).

Every LoRA-wrapped layer of client ``i`` computes ``σ + τ_i``: a shared part σ, aggregated by the
server (eq. 8), plus a private low-rank part ``τ_i = s_τ·B_i A_i`` that never leaves the client
(eqs. 2–3; ``A`` Gaussian, ``B`` zero at init, so τ starts at zero). σ is either

- ``shared: full`` — the full weights of the target modules themselves (the paper's setting;
  fine for MiniLM/RoBERTa and small LLMs): the LoRA-wrapped base weights train and are averaged
  (the PEFT ``default`` adapter stays at its init, ``B = 0``, and is never trained or sent); or
- ``shared: lora`` — a shared LoRA adapter on the frozen base (PEFT's ``default``, for 7B models).

A classifier head (``modules_to_save``) is part of σ in both modes. Per round a sampled client
loads σ̄ and, with ``schedule: alternating`` (eqs. 6–7 = pFedLoRA(1), eqs. 84–85), takes ``E_lora``
steps on τ with σ frozen, then ``E_global`` steps on σ with τ frozen; ``simultaneous`` trains both
together for ``E_lora + E_global`` steps (seed 002's Table 3 ablation = pFedLoRA(2), eq. 86). It
sends σ only. ``E_lora = 0`` is FedAvg of σ; ``E_global = 0`` is local training of τ.

Step budget (seed 002 §3.4: "We set E_lora + E_global = E, where E is the total number of local update
epochs in one round"): the two phases share ONE budget ``E`` = the recipe's ``train.local_steps`` (or
``local_epochs``), so a round trains as many steps as every other strategy's. By default
``E_lora = ⌊lora_share·E + ½⌋`` (``lora_share`` 0.5: the paper sweeps ``E_lora ∈ [0, E]`` in Fig. 4 and
states no single value for its tables, so the even split is fedllm's choice) and ``E_global = E − E_lora``;
giving only ``e_lora`` (or only ``e_global``) takes the rest of ``E`` for the other phase, as the paper's
sweep does; giving both uses the two counts as they are (an explicit per-phase budget).

Aggregation: eq. 8 is the plain mean ``σ̄ = (1/N) Σ_i σ_i`` over the round's clients, the default here
(``weighting: uniform``); ``weighting: examples`` weights clients by their example counts as FedAvg does.

τ is the per-client private adapter of :mod:`fedllm.strategies.private_adapter` (parameters
``<layer>.fedlora.L`` / ``.U``): per-client state in the client store, zero in the global model,
loaded by ``personal_state`` for a client's own model ``σ̄ + τ_i``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from fedllm.common.errors import InputError
from fedllm.common.registry import register_strategy
from fedllm.models.lowrank import is_quantized
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, Phase
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.private_adapter import PrivateFactors
from fedllm.strategies.residual import adapter_layers, recipe_value

SHARED = ("full", "lora")
SCHEDULES = ("alternating", "simultaneous")
UNITS = ("steps", "epochs")


def _is_count(value, integer: bool) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return value >= 0 and (not integer or float(value).is_integer())


@register_strategy("fedlora_pfl")
class FedLoRAPFL(PrivateFactors, FedAvg):
    """FedLoRA (seed 002, Alg. 1): ``θ_i = σ + τ_i``; ``E_lora`` steps on τ_i, then ``E_global = E − E_lora`` on σ; ``σ̄ ← (1/N) Σ_i σ_i`` (eq. 8), τ_i never sent.

    Args:
        shared: ``full`` (σ = the target modules' full weights) or ``lora`` (σ = a shared LoRA adapter).
        schedule: ``alternating`` (τ then σ: pFedLoRA(1)) or ``simultaneous`` (both at once: pFedLoRA(2)).
        e_lora: ``E_lora``: steps (or epochs, see ``unit``) on τ per round; default ``lora_share`` of the
            round's budget ``E`` (``train.local_steps`` / ``local_epochs``); 0 turns FedLoRA into FedAvg of σ.
        e_global: ``E_global``: the same for σ; default ``E − E_lora``; 0 is local training of τ.
        lora_share: the share of ``E`` given to τ when ``e_lora`` and ``e_global`` are not set (default 0.5).
        unit: ``steps`` (optimizer steps) or ``epochs`` (passes over the client's data).
        rank: rank of τ in every layer (default ``lora.r``); or give ``rank_ratio``.
        rank_ratio: the paper's ``R_l``: rank of τ = ``max(1, round(R_l · min(in, out)))`` per layer.
        alpha: scaling ``s_τ = alpha / rank``; default none (``s_τ = 1``: τ = B A as in eq. 3).
        weighting: ``uniform`` (eq. 8's plain mean, the default) or ``examples``.
    """

    name = "fedlora_pfl"
    personalized = True
    private_attr = "fedlora"
    private_salt = 0xF1A

    def __init__(self, shared: str = "full", schedule: str = "alternating", e_lora: Optional[float] = None,
                 e_global: Optional[float] = None, unit: str = "steps", rank: Optional[int] = None,
                 rank_ratio: Optional[float] = None, alpha: Optional[float] = None, weighting: str = "uniform",
                 lora_share: float = 0.5, **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.shared, self.schedule, self.unit = shared, schedule, unit
        self.e_lora, self.e_global, self.lora_share = e_lora, e_global, lora_share
        self.rank, self.rank_ratio, self.alpha = rank, rank_ratio, alpha
        self.modifies_base = shared == "full"

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        for key, allowed in (("shared", SHARED), ("schedule", SCHEDULES), ("unit", UNITS)):
            if key in args and args[key] not in allowed:
                problems.append((key, args[key], f"one of {', '.join(allowed)}"))
        integer = args.get("unit", "steps") == "steps"
        for key in ("e_lora", "e_global"):
            v = args.get(key)
            if v is not None and not _is_count(v, integer):
                problems.append((key, v, "an integer >= 0 (unit: steps)" if integer else "a number >= 0 (unit: epochs)"))
        share = args.get("lora_share", 0.5)
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
            problems.append(("lora_share", share, "a number in [0, 1] (E_lora's share of the round's budget E)"))
        if args.get("e_lora") == 0 and args.get("e_global") == 0:
            problems.append(("e_global", 0, "e_lora or e_global above 0: something must train"))
        rank, ratio = args.get("rank"), args.get("rank_ratio")
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            problems.append(("rank", rank, "an integer >= 1"))
        if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1):
            problems.append(("rank_ratio", ratio, "a number in (0, 1] (the paper's R_l)"))
        if rank is not None and ratio is not None:
            problems.append(("rank_ratio", ratio, "only one of rank and rank_ratio"))
        alpha = args.get("alpha")
        if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
            problems.append(("alpha", alpha, "a positive number"))
        return problems

    # ----- setup
    def _rank(self, shape: tuple[int, int]) -> int:
        if self.rank_ratio is not None:
            return max(1, round(self.rank_ratio * min(shape)))
        return self.rank if self.rank is not None else int(recipe_value(self.recipe, "lora.r", 8))

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        layers = adapter_layers(model)
        self.sizes = {c.client_id: c.num_examples for c in clients}
        source = recipe_value(self.recipe, "source", "<recipe>")
        if self.shared == "full" and any(is_quantized(layer.base) for layer in layers.values()):
            raise InputError(f"{source}: federation.strategy_args.shared: got 'full', which trains the target "
                             "modules' full weights and a 4/8-bit base cannot; expected 'lora' (or model.quantization: "
                             "none)")
        ranks = {name: self._rank(layer.shape) for name, layer in layers.items()}
        for name, layer in layers.items():
            if ranks[name] > min(layer.shape):
                raise InputError(f"{source}: federation.strategy_args.rank: got {ranks[name]}; expected at most "
                                 f"min(out, in) of {name} {layer.shape}")
        scales = {n: (self.alpha / r if self.alpha is not None else 1.0) for n, r in ranks.items()}
        self.attach_private(model, layers, ranks, scales)

    def private_init(self) -> str:
        """τ's ``A`` is Gaussian, ``B`` zero (seed 002 §3.3)."""
        return "gaussian"

    def global_keys(self, model: torch.nn.Module) -> list[str]:
        """σ: the LoRA-wrapped base weights (``full``) or the LoRA adapter (``lora``), plus any trained head."""
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        if self.shared == "lora":
            return trainable
        names = {id(p): n for n, p in model.named_parameters()}
        adapter = {key for layer in self.private_layers.values() for key in (layer.a_key, layer.b_key)}
        bases = [names[id(layer.base.weight)] for layer in self.private_layers.values()]
        return bases + [n for n in trainable if n not in adapter]

    # ----- rounds
    def local_steps(self, value: float, client_id: int) -> int:
        """Optimizer steps of ``E_lora`` / ``E_global`` = ``value`` (in ``unit``) for client ``client_id``."""
        if self.unit == "steps":
            return int(value)
        train = recipe_value(self.recipe, "train", None)
        per_step = train.batch_size * train.grad_accum if train is not None else 1
        return math.ceil(value * self.sizes[client_id] / per_step) if value > 0 else 0

    def phase_steps(self, client_id: int) -> tuple[int, int]:
        """``(E_lora, E_global)`` in optimizer steps for client ``client_id``: one budget ``E`` split (see the
        module docstring) unless both are given."""
        from fedllm.recipe.schedule import steps_per_round

        train = recipe_value(self.recipe, "train", None)
        budget = steps_per_round(train, self.sizes[client_id]) if train is not None else 1
        e_lora = None if self.e_lora is None else self.local_steps(self.e_lora, client_id)
        e_global = None if self.e_global is None else self.local_steps(self.e_global, client_id)
        if e_lora is None and e_global is None:
            e_lora = math.floor(self.lora_share * budget + 0.5)
        if e_global is None:
            e_global = max(budget - e_lora, 0)
        if e_lora is None:
            e_lora = max(budget - e_global, 0)
        return e_lora, e_global

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        tau, sigma = list(self.private_keys), list(global_state)
        e_lora, e_global = self.phase_steps(client_id)
        if self.schedule == "simultaneous":
            phases = [Phase(keys=tau + sigma, steps=e_lora + e_global, name="joint")]
        else:
            phases = [Phase(keys=tau, steps=e_lora, name="personal")] if e_lora else []
            phases += [Phase(keys=sigma, steps=e_global, name="global")] if e_global else []
        return ClientPlan(client_id=client_id, rnd=rnd, state=global_state, phases=phases)

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        self.clear_private()
        return global_state

    def load_state_dict(self, state: StateDict) -> None:
        self.clear_private()
