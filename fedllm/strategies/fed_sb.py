"""Fed-SB (Singhal et al. 2025, arXiv 2502.15436): LoRA-SB adapters, clients train only an ``r × r`` matrix ``R``.

Each LoRA-wrapped weight computes ``W + s·B·R·A`` (LoRA-SB, Ponkshe et al. 2024): ``B`` (out × r) and ``A`` (r × in)
are fixed after initialisation, only ``R`` trains. Because the update is linear in ``R``, averaging the clients'
``R_k`` averages their updates exactly: the paper's ``R^agg = (1/c)·Σ_i R_i``, ``ΔW^agg = B·R^agg·A`` (uniform, as the
authors' ``aggregate_models_fed_sb``; ``weighting: examples`` is exact too), and a client sends
``r²`` numbers per layer; under DP the noise is added to ``R`` alone, in ``r²`` dimensions.

Initialisation (the authors' ``estimate_and_process_grads_torch`` + ``find_and_initialize_grad``; LoRA-SB,
arXiv 2411.19557):
``init: gradient`` approximates the first step of full fine-tuning, ``ΔW = −η·sign(Σ_b ∇_W L_b / n_b)`` over
``init_samples`` training examples (the authors' 50; a seeded draw from all clients' examples, batches of
``train.batch_size``, dropout off), and sets ``(B, R, A) = (U_r, diag(S_r), Vh_r)`` of ``ΔW`` (:func:`latent_factors`),
so the model starts at ``W + s·ΔW_r``. ``η`` is ``init_lr``, by default the authors' ``lr / (warmup_ratio · T)`` — the
first step's learning rate under a linear warmup — with ``train.lr``, ``warmup_ratio`` 0.02 and ``T`` the optimizer
steps one client takes in the run (at least one warmup step: ``η ≤ train.lr``; the authors' ``T`` is the steps of
their one training pass, and they set ``lora.alpha = r``, i.e. ``s = 1``). This reads raw training examples once, outside any DP mechanism, as the
authors' code does: it is refused with ``privacy``. ``init: weights`` is the authors' data-free option
(``find_and_initialize``, LoRA-XS): ``(B, A) = (U_r, diag(S_r)·Vh_r)`` of the pretrained weight, ``R ~ N(0, 1e-5²)``.

DoRA (``lora.use_dora``, Liu et al. 2024, Eq. 5): the layer computes ``m ⊙ V / ‖V‖_c`` with ``V = W + s·B·R·A``. PEFT's
DoRA reads ``B·A`` by calling ``lora_B(lora_A(I))``, so the ``R`` hook below enters its column norm as well as its
output, and nothing is refactorised on the server: ``m`` is well defined, trains beside ``R`` and is averaged with
the same weights as any trainable tensor (the directions average exactly, ``V̄ = W + s·B·R̄·A``; the magnitude as a
trainable tensor). PEFT sets ``m = ‖W + s·B·A‖_c`` when it creates the adapter (``B = 0`` then: ``‖W‖_c``); after
the init writes ``(B, R, A)`` it is set again to ``‖W + s·B·R·A‖_c``, the norms of the weight the layer now starts
from (PEFT's rule), so the DoRA model starts where LoRA-SB's does. Export as below: the pieces ``s·(B·R − B)·A``
go into the base before PEFT's DoRA merge (inside the norm), or stack with ``B`` as a DoRA adapter of rank ``2r``.

Compressed download (``federation.compression.download``): ``R``, ``m`` and a head travel compressed with the server's
error feedback; the server averages the uploaded ``R_k``, reading nothing of what it sent. ``A`` and ``B`` travel
uncompressed (:meth:`FedSB.exact_download_keys`): a client receives them once and keeps them fixed, so a quantised
copy would give each client its own fixed factors (differing with the round it first trained in, as the server's
residual moves) and ``mean_k B_k·R_k·A_k`` would no longer be ``B·R̄·A``, the exactness Fed-SB is built on.

How it runs: ``R`` is an ``nn.Linear(r, r)`` named ``<layer>.fed_sb`` attached to each PEFT LoRA layer and applied
by a forward hook to ``lora_A``'s output (the authors' ``default_lora_latent_mapping``), so opacus sees an ordinary
linear layer for DP-SGD. The global state holds ``A``, ``B`` and ``R`` (checkpoints and exports are self-contained);
``A`` and ``B`` go to a client the first time it trains and stay in its per-client state, later plans carry ``R``
(and a classifier head) only. That entry holds ``r·(in + out)`` numbers per layer per client (checkpointed in
``clients.safetensors``): the price of a gradient init that a node with other data could not recompute. Export: the merged form is exact; the adapter form is a plain PEFT LoRA of rank ``2r``
(``B`` and ``B·R − B`` stacked with ``A``, :meth:`FedSB.kept_factors`), or of rank ``r`` with ``export --rank r``.
"""

from __future__ import annotations

from typing import Any

import torch

from fedllm.common.errors import InputError
from fedllm.common.registry import register_strategy
from fedllm.models.lowrank import SVD_METHODS, dense_weight, is_quantized, latent_factors
from fedllm.models.state import StateDict
from fedllm.recipe.schedule import derived_seed, steps_per_round
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate, Phase
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import adapter_layers, layer_seed

MODULE = "fed_sb"
INITS = ("gradient", "weights")
WEIGHTS_INIT_STD = 1e-5  # the authors' init_module_weights(sigma=0.00001) of R under init: weights
HAS_FACTORS = "fed_sb/has_factors"


def _latent_hook(latent: torch.nn.Linear):
    """Forward hook on ``lora_A``: its output ``x·Aᵀ`` becomes ``x·Aᵀ·Rᵀ`` (then ``lora_B`` and the scaling)."""

    def apply(module: Any, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return latent(output.to(latent.weight.dtype)).to(output.dtype)

    return apply


@register_strategy("fed_sb")
class FedSB(FedAvg):
    """Fed-SB: clients train ``R`` of ``W + s·B·R·A`` (``A``, ``B`` fixed); ``R ← Σ_k p_k R_k`` (exact).

    Args:
        weighting: ``uniform`` (the paper's and the authors' mean, the default) or ``examples``.
        init: ``gradient`` (LoRA-SB: SVD of an approximate first full fine-tuning step) or ``weights`` (LoRA-XS).
        init_samples: training examples the gradient init reads (the authors' 50).
        init_lr: step size ``η`` of the approximated update; 0: ``train.lr / max(1, warmup_ratio · T)`` (authors').
        warmup_ratio: the authors' ``warmup_ratio`` in that default (0.02).
        svd: ``randomized`` (the authors' ``torch.svd_lowrank``, ``niter`` iterations) or ``exact``.
        niter: subspace iterations of the randomized SVD (the authors' 10).
    """

    name = "fed_sb"
    client_batching = False  # plans name the keys that train and carry A, B on a client's first round
    aggregates_by_sum = True  # a weighted mean of R (and the head)

    def __init__(self, weighting: str = "uniform", init: str = "gradient", init_samples: int = 50,
                 init_lr: float = 0.0, warmup_ratio: float = 0.02, svd: str = "randomized", niter: int = 10, **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.init, self.init_samples, self.init_lr, self.svd, self.niter = init, init_samples, init_lr, svd, niter
        self.warmup_ratio = warmup_ratio

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        if args.get("init", "gradient") not in INITS:
            problems.append(("init", args["init"], f"one of {', '.join(INITS)}"))
        if args.get("svd", "randomized") not in SVD_METHODS:
            problems.append(("svd", args["svd"], f"one of {', '.join(SVD_METHODS)}"))
        for key, least in (("init_samples", 1), ("niter", 0)):
            value = args.get(key, least)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                problems.append((key, value, f"an integer >= {least}"))
        lr = args.get("init_lr", 0.0)
        if isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr < 0:
            problems.append(("init_lr", lr, "a number >= 0 (0: train.lr / (warmup_ratio · steps of a client's run))"))
        ratio = args.get("warmup_ratio", 0.02)
        if isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and not 0 < ratio <= 1:
            problems.append(("warmup_ratio", ratio, "a number in (0, 1]"))
        return problems

    # ----- set-up: the latent matrices, the fixed factors
    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        factors = {k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)}
        self.head = [n for n, p in model.named_parameters() if p.requires_grad and n not in factors]
        self.latents: dict[str, torch.nn.Linear] = {}
        for name, layer in self.layers.items():
            a = layer.module.lora_A["default"].weight
            latent = torch.nn.Linear(layer.rank, layer.rank, bias=False, device=a.device, dtype=torch.float32)
            latent.weight.requires_grad_(False)
            torch.nn.init.zeros_(latent.weight)
            layer.module.add_module(MODULE, latent)
            layer.module.lora_A["default"].register_forward_hook(_latent_hook(latent))
            self.latents[name] = latent
        self.latent_keys = [f"{name}.{MODULE}.weight" for name in self.layers]
        self.factor_keys = sorted(factors)
        self.has_factors = torch.zeros(len(clients), dtype=torch.int64)
        data = self.training_data
        if self.init == "weights":
            self._write_factors(self._weights_init())
        elif data is not None:  # elsewhere (export, dry run) the factors come from the checkpoint or do not matter
            self._write_factors(self._gradient_init(model, *data))
        else:
            return
        self._start_magnitudes()

    @torch.no_grad()
    def _start_magnitudes(self) -> None:
        """DoRA: ``m = ‖W + s·B·R·A‖_c`` of the initialised factors (PEFT's own rule at adapter creation, the norm of
        the weight the layer starts from), read through PEFT's ``get_lora_weight``, which calls ``lora_A`` and so
        the ``R`` hook: the DoRA model starts at LoRA-SB's ``W + s·B·R·A`` (module docstring)."""
        for layer in self.layers.values():
            dora = layer.module.lora_magnitude_vector
            if "default" not in dora:
                continue
            product = dora["default"].get_lora_weight(lora_A=layer.module.lora_A["default"],
                                                      lora_B=layer.module.lora_B["default"])
            norm = dora["default"].get_weight_norm(layer.base.weight, product, layer.scale)
            dora["default"].weight.copy_(norm.to(dora["default"].weight.dtype))

    @torch.no_grad()
    def _write_factors(self, factors: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        for name, (b, r, a) in factors.items():
            module = self.layers[name].module
            for target, value in ((module.lora_B["default"].weight, b), (self.latents[name].weight, r),
                                  (module.lora_A["default"].weight, a)):
                target.copy_(value.to(target.device, target.dtype))

    def _weights_init(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """LoRA-XS: ``B = U_r``, ``A = diag(S_r)·Vh_r`` of the pretrained weight; ``R ~ N(0, 1e-5²)`` (seeded)."""
        out = {}
        for name, layer in self.layers.items():
            u, s, vh = latent_factors(dense_weight(layer.base), layer.rank, self.svd, self.niter,
                                      layer_seed(self.seed, name, 0xF5B))
            gen = torch.Generator().manual_seed(layer_seed(self.seed, name, 0xF5B, 1))
            out[name] = (u, torch.randn(layer.rank, layer.rank, generator=gen) * WEIGHTS_INIT_STD, s @ vh)
        return out

    def _gradient_init(self, model: torch.nn.Module, examples: list[dict], collate: Any,
                       batch_loss: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """LoRA-SB: ``(U_r, diag(S_r), Vh_r)`` of ``ΔW = −η·sign(Σ_b ∇_W L_b / n_b)`` of every wrapped weight."""
        quantized = [name for name, layer in self.layers.items() if is_quantized(layer.base)]
        if quantized:
            raise InputError(f"federation.strategy_args.init: got 'gradient' on the quantized layer {quantized[0]}; "
                             "expected 'weights' (a gradient of a 4/8-bit weight does not exist)")
        gen = torch.Generator().manual_seed(derived_seed(self.seed, 0xF5B))
        drawn = torch.randperm(len(examples), generator=gen)[:self.init_samples].tolist()
        weights = {name: layer.base.weight for name, layer in self.layers.items()}
        flags = {name: w.requires_grad for name, w in weights.items()}
        sums = {name: torch.zeros(w.shape, dtype=torch.float32, device=w.device) for name, w in weights.items()}
        was_training = model.training
        model.eval()  # no dropout: every process draws the same init
        try:
            for w in weights.values():
                w.requires_grad_(True)
            size = self.recipe.train.batch_size
            device = next(iter(weights.values())).device
            for start in range(0, len(drawn), size):
                chunk = drawn[start:start + size]
                batch = {k: v.to(device) for k, v in collate([examples[i] for i in chunk]).items()}
                loss = batch_loss(model, batch) / len(chunk)
                for name, grad in zip(weights, torch.autograd.grad(loss, list(weights.values())), strict=True):
                    sums[name] += grad.float()
        finally:
            for name, w in weights.items():
                w.requires_grad_(flags[name])
            model.train(was_training)
        lr = self.init_lr or self.default_init_lr(len(examples) / max(1, len(self.has_factors)))
        return {name: latent_factors(-lr * torch.sign(g).cpu(), self.layers[name].rank, self.svd, self.niter,
                                     layer_seed(self.seed, name, 0xF5B))
                for name, g in sums.items()}

    def default_init_lr(self, client_examples: float) -> float:
        """The authors' ``η = lr / (warmup_ratio · T)`` (at least one warmup step), ``T`` = the optimizer steps a client
        of ``client_examples`` examples takes over the run's rounds."""
        steps = steps_per_round(self.recipe.train, round(client_examples)) * self.recipe.federation.rounds
        return self.recipe.train.lr / max(1.0, self.warmup_ratio * steps)

    # ----- rounds
    def global_keys(self, model: torch.nn.Module) -> list[str]:
        return self.factor_keys + self.latent_keys + self.head

    def shared_keys(self) -> list[str]:
        """What trains and travels every round: ``R`` of every layer and a classifier head."""
        return self.latent_keys + self.head

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        keys = self.shared_keys() + ([] if self.has_factors[client_id] else self.factor_keys)
        return ClientPlan(client_id=client_id, rnd=rnd, state={k: global_state[k] for k in keys},
                          phases=[Phase(keys=self.shared_keys())])

    def open_client(self, plan: ClientPlan) -> None:
        """A client that has ``A`` and ``B`` already loads them from its own store."""
        missing = [k for k in self.factor_keys if k not in plan.state]
        if missing and not all(k in plan.client_state for k in missing):
            raise RuntimeError(f"fed_sb: client {plan.client_id} was not sent A and B and keeps none")
        plan.local = {**plan.local, **{k: plan.client_state[k] for k in missing}}

    def close_client(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        """The ``A`` and ``B`` the client was sent (its first round), else its entry unchanged."""
        if all(k in plan.client_state for k in self.factor_keys):
            return plan.client_state
        return {k: plan.state[k].detach().clone() for k in self.factor_keys}

    def client_upload(self, plan: ClientPlan, trained: StateDict, steps: int) -> StateDict:
        return {k: trained[k] for k in self.shared_keys()}

    def exact_download_keys(self) -> frozenset[str]:
        """``A`` and ``B`` travel uncompressed under a compressed download (module docstring)."""
        return frozenset(self.factor_keys)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        for u in updates:
            self.has_factors[u.client_id] = 1  # it trained, so it holds A and B
        return {**global_state, **super().aggregate(rnd, global_state, updates)}

    def kept_factors(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        """``s·(B·R − B)·A`` beside the PEFT adapter's ``s·B·A``: together the layer's ``s·B·R·A`` (for export)."""
        out = {}
        for name, layer in self.layers.items():
            b = layer.module.lora_B["default"].weight.detach().float()
            r = self.latents[name].weight.detach().float().to(b.device)
            out[name] = [(b @ r - b, layer.module.lora_A["default"].weight.detach().float(), layer.scale)]
        return out

    def state_dict(self) -> StateDict:
        return {HAS_FACTORS: self.has_factors.clone()}

    def load_state_dict(self, state: StateDict) -> None:
        if HAS_FACTORS in state:
            self.has_factors = state[HAS_FACTORS].clone()
