"""FlexLoRA: heterogeneous-rank aggregation by full-size products and SVD hand-back (Bai et al., NeurIPS 2024).

Client ``k`` trains a LoRA of its own rank ``r_k`` (:mod:`fedllm.strategies.client_ranks`: a list or a named
resource distribution). The server forms the full-size update ``ΔW = Σ_k p_k · s·B_k A_k`` (``p_k`` ∝ examples)
and hands each client the truncated SVD of ``ΔW`` at its own rank: ``B = U_r·√(S_r/s)``, ``A = √(S_r/s)·Vh_r``
(the singular values split evenly between the factors), so ``s·B A`` is the best rank-``r_k`` approximation of
``ΔW``. Should ``ΔW`` have fewer than ``r_k`` directions, the remaining rows of ``A`` are a fresh standard LoRA
draw (with ``B`` zero there) so that every direction can train.

The global model is ``W0 + ΔW`` exactly: the clients' pieces ``(B_k, A_k, p_k·s)`` are kept beside the frozen
base (:class:`fedllm.strategies.residual.KeptFactors`, a forward hook adds them; the global adapter itself is
zero), so evaluation and export see the full average (a merged export is exact; an adapter export stacks the
pieces exactly, or ``--rank R`` truncates with the error reported). While a client trains, the hook is off:
the client's model is ``W0 + s·B A`` at its rank. The SVD is taken of the stacked factors through two thin QR
decompositions in float64 (no dense ``out × in`` SVD), so it stays cheap for large layers.

DoRA (``lora.use_dora``): the magnitude ``m`` is averaged with the example weights as any trainable tensor (it goes
down to every client beside its SVD share), and the global layer is ``m̄ ⊙ (W0 + ΔW) / ‖W0 + ΔW‖_c``: ΔW must sit
inside DoRA's column norm, so instead of adding it after the layer the kept pieces are stacked beside the (zero)
global adapter in the factors PEFT's DoRA forward reads (:func:`stack_into_dora`, a pre-hook on each layer's
magnitude module). A client's layer is ``m ⊙ (W0 + s·B A) / ‖·‖_c`` at its rank, as without the pieces.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from fedllm.common.registry import register_strategy
from fedllm.models.state import StateDict, weighted_mean
from fedllm.strategies.base import ClientInfo, ClientPlan, ClientUpdate
from fedllm.strategies.client_ranks import RankedClients, check_rank_args
from fedllm.strategies.fedavg import FedAvg
from fedllm.strategies.residual import (
    KeptFactors,
    adapter_layers,
    drop_moments,
    layer_seed,
    recipe_value,
    standard_factors,
)


def stacked_svd(b_cat: torch.Tensor, a_cat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(U, S, Vh)`` of ``b_cat @ a_cat`` (out × K times K × in) in float64, via QR of each factor."""
    qb, rb = torch.linalg.qr(b_cat.double())
    qa, ra = torch.linalg.qr(a_cat.double().mT)
    u, s, vh = torch.linalg.svd(rb @ ra.mT, full_matrices=False)
    return qb @ u, s, vh @ qa.mT


class _Factor(torch.nn.Module):
    """A LoRA factor as PEFT's DoRA forward uses one: ``weight`` (for shapes) and ``x ↦ x·weightᵀ``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


def stack_into_dora(kept: KeptFactors, name: str):
    """A forward pre-hook (with kwargs) for layer ``name``'s DoRA magnitude module: while ``kept`` is active, PEFT's
    DoRA forward gets ``[A; A_1; …; A_K]`` and ``[B, s_1 B_1/s, …, s_K B_K/s]``, so that ``s·B A + Σ_j s_j B_j A_j``
    enters both its column norm and its output (DoRA, Liu et al. 2024, Eq. 5)."""
    def stacked(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        pieces = kept.factors.get(name)
        if not kept.active or not pieces:
            return None
        a, b, scaling = kwargs["lora_A"].weight, kwargs["lora_B"].weight, kwargs["scaling"]
        a_cat = torch.cat([a] + [pa.to(a.device, a.dtype) for _, pa, _ in pieces], 0)
        b_cat = torch.cat([b] + [(pb * (s / scaling)).to(b.device, b.dtype) for pb, _, s in pieces], 1)
        return args, {**kwargs, "lora_A": _Factor(a_cat), "lora_B": _Factor(b_cat)}

    return stacked


def is_dora_layer(layer: Any) -> bool:
    """True when the PEFT layer's ``default`` adapter uses DoRA (a magnitude vector)."""
    return "default" in getattr(layer.module, "lora_magnitude_vector", {})


@register_strategy("flexlora")
class FlexLoRA(RankedClients, FedAvg):
    """FlexLoRA (Bai et al., NeurIPS 2024): ``ΔW = Σ_k p_k·s·B_k A_k``; client ``k`` receives the rank-``r_k`` truncated SVD of ``ΔW``.

    Args:
        client_ranks: rank of every client: a list (one per client, each at most ``lora.r``), or a resource
            distribution ``uniform`` | ``heavy_tail_light`` | ``heavy_tail_strong`` | ``normal`` over
            ``rank_levels``. Default: every client at ``lora.r``.
        rank_levels: the four levels' ranks for a named distribution (default ``lora.r`` /8, /4, /2, /1).
        weighting: ``examples`` (``p_k = n_k / n``, the paper) or ``uniform``.
    """

    name = "flexlora"
    aggregates_by_sum = False
    needs_individual_updates = "takes each client's full product s·B_k·A_k (a nonlinear function of one client's upload) and its SVD"

    def __init__(self, client_ranks: Any = None, rank_levels: list | None = None, weighting: str = "examples",
                 **kwargs):
        super().__init__(weighting=weighting, **kwargs)
        self.client_ranks, self.rank_levels = client_ranks, rank_levels

    @classmethod
    def check_values(cls, args):
        return super().check_values(args) + check_rank_args(args)

    def setup(self, model: torch.nn.Module, clients: list[ClientInfo]) -> None:
        self.layers = adapter_layers(model)
        self.setup_ranks(len(clients))
        dora = any(is_dora_layer(layer) for layer in self.layers.values())
        self.kept = KeptFactors(self.layers, live=not dora)
        for name, layer in self.layers.items():
            if dora:  # ΔW inside DoRA's column norm (module docstring)
                layer.module.lora_magnitude_vector["default"].register_forward_pre_hook(
                    stack_into_dora(self.kept, name), with_kwargs=True)
        self._svd: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    def svd(self) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """``{layer: (U, S, Vh)}`` of the current ``ΔW / s`` (computed once per aggregation)."""
        if self._svd is None:
            self._svd = {}
            for name, pieces in self.kept.factors.items():
                b_cat = torch.cat([b * (w / self.layers[name].scale) for b, _, w in pieces], 1)
                self._svd[name] = stacked_svd(b_cat, torch.cat([a for _, a, _ in pieces], 0))
        return self._svd

    def client_factors(self, rnd: int, client_id: int, global_state: StateDict) -> StateDict:
        """Client ``client_id``'s rank-``r_k`` ``(B, A)`` of every layer: the truncated SVD of ``ΔW``."""
        rank, out = self.ranks[client_id], {}
        for name, layer in self.layers.items():
            like_b, like_a = global_state[layer.b_key], global_state[layer.a_key]
            u, s, vh = self.svd()[name]
            keep = min(rank, s.numel())
            root = torch.sqrt(s[:keep])  # S is of ΔW / s, so s·B·A = U_r (s·S_r) Vh_r
            b = torch.zeros(like_b.shape[0], rank, dtype=torch.float64, device=u.device)
            a = torch.zeros(rank, like_a.shape[1], dtype=torch.float64, device=u.device)
            b[:, :keep], a[:keep] = u[:, :keep] * root, root[:, None] * vh[:keep]
            if keep < rank:  # ΔW has fewer directions than the client's rank: fresh trainable rows
                _, fresh = standard_factors(layer, recipe_value(self.recipe, "lora.init", "default"),
                                            layer_seed(self.seed, name, 0xF1E, rnd, client_id))
                a[keep:] = fresh[keep:rank].to(a.device, a.dtype)
            out[layer.b_key], out[layer.a_key] = b.to(like_b.dtype), a.to(like_a.dtype)
        return out

    def configure_client(self, rnd: int, client_id: int, global_state: StateDict) -> ClientPlan:
        state = dict(global_state)
        if self.kept.factors:
            state.update(self.client_factors(rnd, client_id, global_state))
        return ClientPlan(client_id, rnd, self.truncate(state, self.ranks[client_id]))

    def open_client(self, plan: ClientPlan) -> None:
        """Pad the client's factors to the adapter's rank and switch the global ``ΔW`` off while it trains."""
        super().open_client(plan)
        self.kept.active = False

    def client_optimizer_state(self, rnd: int, client_id: int, state):
        """Each round's factors are a new SVD hand-back: their moments never carry over (the head's do)."""
        return drop_moments(state, self.factor_keys)

    def aggregate(self, rnd: int, global_state: StateDict, updates: list[ClientUpdate]) -> StateDict:
        weights = self.weights(updates)
        total = sum(weights)
        self.kept.clear()
        for name, layer in self.layers.items():
            for u, w in zip(updates, weights, strict=True):
                self.kept.append(name, u.state[layer.b_key], u.state[layer.a_key], layer.scale * w / total)
        self.kept.active, self._svd = True, None
        out = {k: torch.zeros_like(v) if k in self.factor_keys else v for k, v in global_state.items()}
        heads = [{k: v for k, v in u.state.items() if k not in self.factor_keys} for u in updates]
        if heads[0]:
            out.update(weighted_mean(heads, weights))
        return out

    def kept_factors(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor, float]]]:
        return self.kept.as_dict()

    def state_dict(self) -> StateDict:
        return self.kept.state_dict()

    def load_state_dict(self, state: StateDict) -> None:
        self.kept.load_state_dict(state)
        self.kept.active, self._svd = True, None
