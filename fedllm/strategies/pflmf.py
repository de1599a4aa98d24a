"""pFL^MF: personalized FL via low-rank matrix factorisation (seed 004, Alg. 1, eqs. 6–9).

Client ``i``'s trainable vector ``θ_i ∈ R^d`` — every trainable tensor of the PEFT model, i.e. the
LoRA factors ``A, B`` of each target layer and a classifier head (``modules_to_save``), flattened in
``named_parameters`` order — is ``θ_i = U v_i``: ``U ∈ R^{d×r}`` is shared and updated by the server,
``v_i ∈ R^r`` is private (per-client state in the client store, never sent). Per round a sampled
client receives ``U``, takes ``K`` local steps on ``v_i`` with the recipe's optimizer and learning
rate (eq. 8 with plain ``sgd``; the ``1/n`` of eq. 8 is folded into ``η_v``), and sends
``G_i = ∇f_i(U v_i^t) v_i^tᵀ`` (d × r numbers), the gradient of its first local step's batch with
respect to ``U`` at the round's starting ``v_i^t``. The server steps ``U ← U − η_U · mean_i G_i``
(eq. 9, Alg. 1's mean over the sampled clients).

Initialisation: ``U⁰ = [θ⁰ | Z]`` and ``v_i⁰ = e_1`` for every client, where ``θ⁰`` is the usual
LoRA init (``A`` random, ``B = 0``, the head as loaded) and ``Z``'s ``r − 1`` columns are seeded
Gaussian directions scaled to ``init_scale·‖θ⁰‖``: every client starts at exactly the pretrained
model's output, and ``v``'s other coordinates get non-zero gradients ``Zᵀ∇f`` from the first step.

How it runs: ``U`` and ``v`` are parameters ``pflmf.U`` / ``pflmf.v`` of a small module attached to the
PEFT model. While a client trains, forward hooks on the ``nn.Linear`` modules owning θ's tensors
compute them as slices of ``U v``, so autograd gives ``v``'s gradient ``Uᵀ∇f(θ)``; during the first
step they use a copy of ``U`` that requires grad, whose gradient is ``∇f(θ) vᵀ = G_i``. Outside
training the hooks are idle and θ's tensors hold materialised values: the global state is ``U`` plus
``θ = U v⁰`` (the model a new client starts from; only ``U`` is sent), and a client's personal model
is ``θ_i = U v_i`` (``personal_state``).

Memory: the server holds ``U`` (d·r) and the round's uploads, never the d × n matrix of all ``θ_i``;
a client stores ``v_i`` (r numbers) between rounds and holds ``U``, ``θ`` and ``G_i`` while it trains.

DoRA (``lora.use_dora``): θ also holds each layer's magnitude vector ``m`` (``...lora_magnitude_vector.default.weight``),
read inside PEFT's DoRA module rather than through an ``nn.Linear``. While a client trains, a forward hook on that
module calls it again with ``m`` = its slice of ``U v`` (``torch.func.functional_call``), so the layer computes
``m ⊙ (W + s·B A) / ‖W + s·B A‖_c`` with every tensor from ``U v`` (PEFT's DoRA reads ``B A`` through the factors'
hooked forwards) and autograd carries ``m``'s gradient into ``v`` and ``G_i``; it costs a second DoRA forward of
each layer while training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F

from fedllm.common.errors import InputError
from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase, Strategy

MODULE = "pflmf"
U_KEY, V_KEY = f"{MODULE}.U", f"{MODULE}.v"


class Factors(torch.nn.Module):
    """The shared ``U`` (d × r) and the loaded client's ``v`` (r) as model parameters (frozen by default)."""

    def __init__(self, d: int, r: int, device: Any = None):
        super().__init__()
        self.U = torch.nn.Parameter(torch.zeros(d, r, device=device), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(r, device=device), requires_grad=False)


@dataclass
class Slice:
    """One tensor of θ: its parameter name, owning module attribute and place in the flat vector."""

    name: str
    attr: str  # "weight" or "bias"
    start: int
    shape: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + int(torch.Size(self.shape).numel())


@register_strategy("pflmf")
class PFLMF(Strategy):
    """pFL^MF (seed 004, Alg. 1): ``θ_i = U v_i``; ``K`` steps ``v_i ← v_i − η_v Uᵀ∇f_i(U v_i)``; ``U ← U − η_U · mean_i ∇f_i(U v_i^t) v_i^tᵀ``.

    Args:
        rank: ``r``, columns of ``U`` (the rank of the clients' stacked parameters Θ).
        eta_u: the server's step size ``η_U``.
        eta_v: the clients' step size ``η_v``: null (the recipe's ``train.lr`` and schedule), a number,
            or ``theorem`` (Theorem 1: ``η_v = p·η_U/K`` with ``p`` the fraction of clients sampled per
            round and ``K`` the client's local steps).
        init_scale: norm of ``U⁰``'s extra columns relative to ``‖θ⁰‖``.
        weighting: ``uniform`` (Alg. 1's mean) or ``examples`` (weights = client example counts).
    """

    name = "pflmf"
    late_update = ("dropped: its private v_i stays as before the round and U steps on the mean G_i of the clients that "
                   "arrived; its next round starts from the new U")
    aggregates_by_sum = False
    needs_individual_updates = "uploads gradients G_i taken at each client's private vector, not a change of the state it was sent"
    personalized = True

    def __init__(self, rank: int = 5, eta_u: float = 1e-2, eta_v: Union[None, float, str] = None,
                 init_scale: float = 1.0, weighting: str = "uniform", **kwargs):
        super().__init__(**kwargs)
        self.rank, self.eta_u, self.eta_v = rank, eta_u, eta_v
        self.init_scale, self.weighting = init_scale, weighting
        self._live: Optional[dict[str, Any]] = None  # client side, while a client trains

    @classmethod
    def check_values(cls, args):
        problems = []
        rank = args.get("rank", 1)
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            problems.append(("rank", rank, "an integer >= 1"))
        if not args.get("eta_u", 1.0) > 0:
            problems.append(("eta_u", args["eta_u"], "a positive number"))
        eta_v = args.get("eta_v")
        if eta_v is not None and eta_v != "theorem" and (
                isinstance(eta_v, (bool, str)) or not isinstance(eta_v, (int, float)) or eta_v <= 0):
            problems.append(("eta_v", eta_v, "null (train.lr), a positive number or 'theorem'"))
        if args.get("init_scale", 1.0) < 0:
            problems.append(("init_scale", args["init_scale"], "a number >= 0"))
        w = args.get("weighting", "uniform")
        if w not in ("examples", "uniform"):
            problems.append(("weighting", w, "'examples' or 'uniform'"))
        return problems

    # ----- setup
    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        from fedllm.recipe.schedule import derived_seed

        train = getattr(self.recipe, "train", None)
        source = getattr(self.recipe, "source", "<recipe>")
        if train is not None and train.dtype == "fp16":
            raise InputError(f"{source}: train.dtype: got 'fp16', whose loss scaling G_i = ∇f(U v) vᵀ would carry; "
                             "expected fp32 or bf16 with pflmf")
        self.sizes = {c.client_id: c.num_examples for c in clients}
        self.slices: list[Slice] = []
        owners: dict[str, list[Slice]] = {}
        start = 0
        from peft.tuners.lora.dora import DoraLinearLayer

        dora: dict[str, Slice] = {}
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            owner, attr = name.rsplit(".", 1)
            module = model.get_submodule(owner)
            if isinstance(module, DoraLinearLayer) and attr == "weight":  # DoRA's magnitude (module docstring)
                dora[owner] = piece = Slice(name, attr, start, tuple(p.shape))
                self.slices.append(piece)
                start = piece.stop
                continue
            if not isinstance(module, torch.nn.Linear) or attr not in ("weight", "bias"):
                raise InputError(f"{source}: lora.modules_to_save: trainable {name} is not the weight or bias of a "
                                 "linear layer; expected linear layers only (pflmf factorises those)")
            piece = Slice(name, attr, start, tuple(p.shape))
            self.slices.append(piece)
            owners.setdefault(owner, []).append(piece)
            start = piece.stop
        if not self.slices:
            raise InputError(f"{source}: federation.strategy: pflmf found no trainable parameters to factorise")
        self.d = start
        device = next(model.parameters()).device
        params = dict(model.named_parameters())
        theta0 = torch.cat([params[s.name].detach().float().reshape(-1) for s in self.slices]).to(device)
        gen = torch.Generator().manual_seed(derived_seed(self.seed, 0x9F1))
        z = torch.randn(self.d, self.rank - 1, generator=gen).to(device)
        scale = (theta0.norm().double() * self.init_scale).float()  # a tensor: no host sync, works on the meta device
        z = z / z.norm(dim=0, keepdim=True).clamp_min(1e-30) * scale
        self.factors = Factors(self.d, self.rank, device)
        with torch.no_grad():
            self.factors.U.copy_(torch.cat([theta0[:, None], z], 1))
            self.factors.v.copy_(self.v0())
        model.add_module(MODULE, self.factors)
        self.model = model
        for owner, pieces in owners.items():
            model.get_submodule(owner).register_forward_hook(self._hook({p.attr: p for p in pieces}))
        # the first step's copy of U is made before the decoder layers run (eagerly, outside train.compile's graphs)
        model.get_input_embeddings().register_forward_pre_hook(self._capture_leaf)
        self._in_dora = False
        for owner, piece in dora.items():
            model.get_submodule(owner).register_forward_hook(self._dora_hook(piece), with_kwargs=True)

    def v0(self) -> torch.Tensor:
        """Every client's initial ``v`` (``e_1``)."""
        v = torch.zeros(self.rank, device=self.factors.U.device)
        v[0] = 1.0
        return v

    def _hook(self, pieces: dict[str, Slice]):
        def factorised(module: Any, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
            if self._live is None:
                return None
            u, v = self._u(), self.factors.v
            values = {a: (u[p.start:p.stop] @ v).view(p.shape) for a, p in pieces.items()}
            weight = values.get("weight", module.weight)
            bias = values.get("bias", module.bias)
            x = args[0]
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))

        return factorised

    def _dora_hook(self, piece: Slice):
        def factorised_magnitude(module: Any, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
            if self._live is None or self._in_dora:
                return None
            m = (self._u()[piece.start:piece.stop] @ self.factors.v).view(piece.shape)
            self._in_dora = True  # the call below runs this hook again: let it pass
            try:
                return torch.func.functional_call(module, {"weight": m.to(module.weight.dtype)}, args, kwargs)
            finally:
                self._in_dora = False

        return factorised_magnitude

    def _capture_leaf(self, *_) -> None:
        """Before a forward pass of the first step: the copy of ``U`` that collects ``G_i`` (made here, on the input
        embedding's call, rather than in a layer's hook: under ``train.compile`` making a leaf inside a compiled layer
        broke its graph, and dynamo then traced every frame below the break, ~7x the compile time of one graph)."""
        live = self._live
        if live is not None and live["capture"] and live["leaf"] is None:
            live["leaf"] = self.factors.U.detach().clone().requires_grad_(True)

    def _u(self) -> torch.Tensor:
        """``U`` as the hooks use it: during the first step a copy that collects ``G_i``."""
        live = self._live
        if not live["capture"]:
            return self.factors.U
        self._capture_leaf()  # made already, unless a model ran its layers without its input embedding
        return live["leaf"]

    def global_keys(self, model: torch.nn.Module) -> list[str]:
        """``U`` plus θ's tensors (materialised as ``U v⁰``)."""
        return [U_KEY] + [s.name for s in self.slices]

    @torch.no_grad()
    def materialise(self, u: torch.Tensor, v: torch.Tensor) -> StateDict:
        """θ's tensors for ``θ = U v``, keyed by parameter name."""
        params = dict(self.model.named_parameters())
        theta = u.float() @ v.float().to(u.device)
        return {s.name: theta[s.start:s.stop].view(s.shape).to(params[s.name].dtype) for s in self.slices}

    # ----- server
    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        return ClientPlan(client_id=client_id, rnd=rnd, state={U_KEY: global_state[U_KEY]},
                          phases=[Phase(keys=[V_KEY], name="v")])

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        self._live = None  # hooks idle on the server, even after a client that failed mid-training
        u = global_state[U_KEY]
        weights = [1.0 if self.weighting == "uniform" else float(x.num_examples) for x in updates]
        total = sum(weights)
        mean = torch.zeros_like(u, dtype=torch.float32)
        for w, x in zip(weights, updates, strict=True):
            g = x.state[U_KEY]
            if g.shape != u.shape:
                raise ValueError(f"client {x.client_id}: G has shape {tuple(g.shape)}, U is {tuple(u.shape)}")
            mean += (w / total) * g.to(mean.device, torch.float32)
        new_u = (u.float() - self.eta_u * mean).to(u.dtype)
        return {U_KEY: new_u, **self.materialise(new_u, self.v0())}

    def personal_state(self, client_id: int, client_state: StateDict) -> Optional[StateDict]:
        """Client ``client_id``'s θ_i = U v_i (``v⁰`` if it never trained) and its ``v_i``."""
        v = client_state[V_KEY].to(self.factors.U.device, copy=True) if client_state else self.v0()
        return {**self.materialise(self.factors.U, v), V_KEY: v}

    # ----- client
    def step_size(self, client_id: int, default: float) -> float:
        """``η_v`` of client ``client_id``: the round's lr, the configured number, or Theorem 1's ``p·η_U/K``."""
        if self.eta_v is None:
            return default
        if self.eta_v != "theorem":
            return float(self.eta_v)
        from fedllm.recipe.schedule import steps_per_round

        p = self.recipe.sampled_per_round() / self.recipe.federation.num_clients
        return p * self.eta_u / steps_per_round(self.recipe.train, self.sizes[client_id])

    def open_client(self, plan: ClientPlan) -> None:
        """Load ``v_i`` (``v⁰`` the first time), set ``η_v`` and switch the hooks on."""
        v = plan.client_state.get(V_KEY)
        plan.local = {V_KEY: v.to(self.factors.v.device, copy=True) if v is not None else self.v0()}
        plan.lr = self.step_size(plan.client_id, plan.lr)
        self._live = {"capture": True, "leaf": None}

    def after_step(self, model: torch.nn.Module, plan: ClientPlan) -> None:
        """After the first step: keep ``G_i`` (the gradient with respect to ``U`` at ``v_i^t``)."""
        live = self._live
        if live is not None and live["capture"]:
            leaf = live["leaf"]
            plan.extra["G"] = leaf.grad.detach().clone() if leaf is not None and leaf.grad is not None \
                else torch.zeros_like(self.factors.U)
            live["capture"], live["leaf"] = False, None

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """Switch the hooks off; the client keeps its new ``v_i``."""
        self._live = None
        return {V_KEY: trained[V_KEY]}

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """``G_i`` under ``U``'s key (d × r numbers); ``v_i`` stays on the client."""
        return {U_KEY: plan.extra["G"]}
