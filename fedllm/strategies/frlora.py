"""FRLoRA: federated residual low-rank adaptation (seed 001, Alg. 1) and its ablations v1/v2/v3 (§4.4).

Per LoRA-wrapped weight ``W0`` (scaling ``s = alpha / r``):

- init: ``U,S,Vh = svd(W0)``, ``B0 = U_r·diag(√(S_r/s))``, ``A0 = diag(√(S_r/s))·Vh_r``; the base becomes
  ``Ŵ0 = W0 − s·B0A0`` so the model computes exactly what it did before;
- every round each sampled client starts from ``(B0, A0)`` on the current base ``Ŵ^{t−1}``; the server
  averages A and B separately; ``ΔW^t = s·(B̄^t Ā^t − B0A0)`` is added to the base (in fp32) on the
  server and on every client, participating or not; the model in memory always holds
  ``Ŵ^t + s·B0A0`` (the final weight ``W̃^T``).

The variants differ only in where each round's clients start from (``reinit``) and how it begins
(``init``): the merge ``base ← base + s·(B̄Ā − B_next A_next)`` keeps the model's output unchanged.

Ablations (§4.4): v1 trains FedAvg from the principal init and never merges; v2 merges ``s·B̄Ā`` and
re-initialises with "zero and Gaussian noise" each round, as the paper says: ``B = 0`` and ``A ~ N(0, 1/r²)``
(PEFT's ``gaussian`` LoRA init), drawn with a seed every client derives alike, also for the initial
adapter (whatever ``lora.init`` says); v3 merges ``s·B̄Ā`` and re-runs the SVD init on the new weight.

Optimizer moments (``train.optimizer_state: per_client``) follow the one rule of all merge-and-reinit
strategies (:func:`~fedllm.strategies.residual.drop_moments`): FRLoRA restarts every round from the same
fixed ``(B0, A0)``, so its per-client moments are kept (as the official code keeps a per-client AdamW
state); v2's and v3's adapter is a newly drawn / newly derived value every round, so its moments are
dropped before each client trains again; v1 re-initialises nothing and keeps them. A classifier head
is never re-initialised and always keeps its moments.

Precision: with ``residual: auto`` an fp32 base is merged in place; a 4/8-bit or bf16/fp16 base is left
untouched and the accumulated change (including ``−s·B0A0``) is kept as an fp32 dense residual per layer,
added to the layer's output by a forward hook, so nothing is lost to re-quantisation or rounding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedllm.common.registry import register_strategy
from fedllm.models.lowrank import SVD_METHODS, principal_factors, product
from fedllm.models.state import DTYPES, StateDict
from fedllm.runs.base_history import LowRankMerge
from fedllm.strategies.base import ClientInfo
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import (
    RESIDUAL_MODES,
    BaseUpdates,
    adapter_layers,
    drop_moments,
    layer_seed,
    recipe_value,
    resolve_residual_mode,
    standard_factors,
    to_wire,
)

MAX_NITER = 100
"""Most subspace iterations of the randomized SVD a recipe may ask for."""


@register_strategy("frlora")
class FRLoRA(FedAvg):
    """FRLoRA (Yan et al., ICLR 2025, Alg. 1): ``Ŵ^t = Ŵ^{t−1} + s·(B̄^t Ā^t − B0A0)`` on every client, then all restart from the principal ``(B0, A0)``.

    Args:
        weighting: ``uniform`` (Alg. 1 line 9 and the official code: ``1/K``) or ``examples``.
        svd: ``exact`` (``torch.linalg.svd``) or ``randomized`` (``torch.svd_lowrank``, seeded per layer
            from the recipe seed, so every process computes the same factors).
        niter: subspace iterations of the randomized SVD.
        oversample: extra probe vectors of the randomized SVD (``q = r + oversample``).
        residual: ``auto``, ``merge`` (add into the base weights) or ``dense`` (fp32 residual beside
            the base; required for a 4/8-bit base, chosen by ``auto`` for any non-fp32 base).
    """

    name = "frlora"
    async_refusal = ("merges the round's mean factors into the base each round and restarts the adapter: a stale "
                     "upload's factors belong to a base that is gone (FedBuff is defined for FedAvg and FedOpt)")
    late_update = ("dropped: the base merges ΔW from the arrived clients' means B̄, Ā only, every client (the late one "
                   "too) applies that merge, and the late client's next round starts from (B0, A0) on the new base")
    client_batching = True  # client side: FedAvg's plus dropping stale moments (batched passes start without moments)
    after_aggregate_reads_download = True  # the merge subtracts the factors the clients started from
    init = "principal"  # how the run starts: "principal" (SVD init) or "gaussian" (B = 0, A ~ N(0, 1/r²))
    reinit = "principal"  # where each round starts: principal (B0, A0) | gaussian | resvd | none (no merge)
    restoring = False
    """Set before :meth:`setup` by a caller that restores a checkpoint with a base history next (an export): the
    checkpoint supplies the base or residual of every layer, the adapter and the start factors, so the set-up skips
    the init (a 7B model's SVDs, and the dense residuals it would build only for the restore to replace them)."""

    def __init__(self, weighting: str = "uniform", svd: str = "exact", niter: int = 4, oversample: int = 8,
                 residual: str = "auto", **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.svd, self.niter, self.oversample, self.residual = svd, niter, oversample, residual

    @classmethod
    def check_values(cls, args):
        problems = super().check_values(args)
        if args.get("svd", "exact") not in SVD_METHODS:
            problems.append(("svd", args["svd"], f"one of {', '.join(SVD_METHODS)}"))
        for key in ("niter", "oversample"):
            v = args.get(key, 0)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                problems.append((key, v, "an integer >= 0"))
        niter = args.get("niter", 0)
        if isinstance(niter, int) and niter > MAX_NITER:
            problems.append(("niter", niter, f"an integer in 0..{MAX_NITER} (subspace iterations; 2 to 10 are usual)"))
        if args.get("residual", "auto") not in RESIDUAL_MODES:
            problems.append(("residual", args["residual"], f"one of {', '.join(RESIDUAL_MODES)}"))
        return problems

    # ----- helpers
    def _wire(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return to_wire(t, self.comm_dtype, like)

    def _principal(self, name: str, weight: torch.Tensor, rnd: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[name]
        return principal_factors(weight, layer.rank, layer.scale, self.svd, self.niter, self.oversample,
                                 seed=layer_seed(self.seed, name, 0x5BD, rnd))

    def _gaussian(self, name: str, rnd: int) -> tuple[torch.Tensor, torch.Tensor]:
        """LoRA's "zero and Gaussian noise" init of layer ``name`` for round ``rnd`` (0: the initial adapter)."""
        return standard_factors(self.layers[name], "gaussian", layer_seed(self.seed, name, 0x1A17, rnd))

    # ----- hooks
    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.num_clients = len(clients)
        self.base = BaseUpdates(self.layers, resolve_residual_mode(self.residual, self.layers))
        self.modifies_base = self.base.modifies_base
        self.sync_numel = sum(layer.numel for layer in self.layers.values())
        self.start: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if self.restoring:
            self.base.restore_needs = set(self.layers) if self.init == "principal" else set()
            return
        with torch.no_grad():
            for name, layer in self.layers.items():
                a_param, b_param = layer.module.lora_A["default"].weight, layer.module.lora_B["default"].weight
                if self.init == "principal":
                    b0, a0 = self._principal(name, self.base.weight(name), 0)
                    b_param.copy_(self._wire(b0, b_param))
                    a_param.copy_(self._wire(a0, a_param))
                    self.base.add(name, LowRankMerge([(b_param, a_param, -layer.scale)]))
                elif self.init == "gaussian":
                    b0, a0 = self._gaussian(name, 0)
                    b_param.copy_(self._wire(b0, b_param))
                    a_param.copy_(self._wire(a0, a_param))
                self.start[name] = (b_param.detach().clone(), a_param.detach().clone())

    def after_aggregate(self, rnd: int, model: torch.nn.Module, global_state: StateDict) -> StateDict:
        if self.reinit == "none":
            return global_state
        out = dict(global_state)
        for name, layer in self.layers.items():
            b_bar = global_state[layer.b_key].to(DTYPES[self.comm_dtype])  # what every client receives
            a_bar = global_state[layer.a_key].to(DTYPES[self.comm_dtype])
            b_now, a_now = self.start[name]
            # the adapter's part of the model after the round: s·B_now·A_now plus the clients' progress
            # s·(B̄Ā − B_s·A_s) from the factors they started from (uncompressed B_s·A_s = B_now·A_now: s·B̄Ā)
            moved = [(b_bar, a_bar, layer.scale)] + self._started_from(layer, b_now, a_now)
            if self.reinit == "principal":
                b_next, a_next = b_now, a_now
            else:
                if self.reinit == "gaussian":
                    b_new, a_new = self._gaussian(name, rnd)
                else:  # resvd: the principal factors of the new full weight
                    learned = sum(product(b, a, s).to(b_now.device) for b, a, s in moved)
                    b_new, a_new = self._principal(name, self.base.weight(name).to(learned.device) + learned, rnd)
                b_next, a_next = self._wire(b_new, b_now), self._wire(a_new, a_now)
            # the model moves by the progress and restarts from (B_next, A_next): s·B_now·A_now is cancelled by the
            # restart when (B_next, A_next) = (B_now, A_now); low rank in every variant (v3's re-SVD only chooses
            # B_next, A_next)
            if self.downloaded is not None and self.reinit == "principal":
                moved = moved[:-1]
            else:
                moved = moved + [(b_next, a_next, -layer.scale)]
            self.base.add(name, LowRankMerge(moved), rnd)
            self.start[name] = (b_next.clone(), a_next.clone())
            out[layer.b_key] = b_next.clone().to(global_state[layer.b_key].dtype)
            out[layer.a_key] = a_next.clone().to(global_state[layer.a_key].dtype)
        return out

    def _started_from(self, layer, b_now: torch.Tensor, a_now: torch.Tensor) -> list:
        """``[(B_s, A_s, −s), (B_now, A_now, s)]`` when the download was compressed: the clients started from the
        dequantised ``(B_s, A_s)`` (:meth:`~fedllm.strategies.base.Strategy.received`), the server's model from
        ``(B_now, A_now)``; none otherwise (both are ``(B_now, A_now)``)."""
        if self.downloaded is None:
            return []
        sent = self.received({layer.b_key: b_now, layer.a_key: a_now})
        return [(sent[layer.b_key], sent[layer.a_key], -layer.scale), (b_now, a_now, layer.scale)]

    def reinitialised_at(self, rnd: int) -> list[str]:
        """v2 and v3 draw or derive a new adapter every round: its download residual restarts (FRLoRA's fixed
        ``(B0, A0)`` keeps its own, so the starts it sends average to ``(B0, A0)``)."""
        if self.reinit not in ("gaussian", "resvd"):
            return []
        return [k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)]

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """Drop the adapter's moments when every round re-draws it (v2, v3); FRLoRA and v1 keep them."""
        if self.reinit not in ("gaussian", "resvd"):
            return state
        return drop_moments(state, [k for layer in self.layers.values() for k in (layer.a_key, layer.b_key)])

    def extra_download_bytes(self, rnd: int, sampled: list[int], num_clients: int, comm_dtype: str) -> dict[int, int]:
        """Clients outside the round receive ``(B̄^t, Ā^t)`` to apply ``ΔW^t`` too (seed 001, Table 14), and under a
        compressed download the round's compressed ``(B_s, A_s)`` the merge subtracts (codes and absmax)."""
        if self.reinit == "none":
            return {}
        size = self.sync_numel * DTYPES[comm_dtype].itemsize
        c = recipe_value(self.recipe, "federation.compression", None)
        if c is not None and c.download != "none":
            from fedllm.models.compression import packed_bytes

            size += sum(packed_bytes(w.numel(), c.download, c.block_size) for layer in self.layers.values()
                        for w in (layer.module.lora_A["default"].weight, layer.module.lora_B["default"].weight))
        return {c: size for c in range(num_clients) if c not in set(sampled)}

    def base_residuals(self) -> Mapping[str, torch.Tensor]:
        return self.base.residuals()

    def state_dict(self) -> StateDict:
        state = self.base.state_dict()
        for name, (b, a) in self.start.items():
            state[f"start/{name}/B"] = b
            state[f"start/{name}/A"] = a
        return state

    def load_state_dict(self, state: StateDict) -> None:
        self.base.load_state_dict(state)
        for name in self.layers:
            if f"start/{name}/B" in state:
                self.start[name] = (state[f"start/{name}/B"].clone(), state[f"start/{name}/A"].clone())


@register_strategy("frlora_v1")
class FRLoRAv1(FRLoRA):
    """FRLoRA-v1 (seed 001 §4.4): FedAvg from FRLoRA's principal init (FedAvg + PiSSA): ``B, A ← mean_k (B_k, A_k)``, never merged."""

    name = "frlora_v1"
    reinit = "none"


@register_strategy("frlora_v2")
class FRLoRAv2(FRLoRA):
    """FRLoRA-v2 (seed 001 §4.4): residual merge ``Ŵ^t = Ŵ^{t−1} + s·B̄^t Ā^t``, then "zero and Gaussian noise" (B = 0, A ~ N(0, 1/r²)) each round."""

    name = "frlora_v2"
    init = "gaussian"
    reinit = "gaussian"


@register_strategy("frlora_v3")
class FRLoRAv3(FRLoRA):
    """FRLoRA-v3 (seed 001 §4.4): ``W^t = Ŵ^{t−1} + s·B̄^t Ā^t``, then re-run the SVD init on ``W^t`` every round."""

    name = "frlora_v3"
    reinit = "resvd"
