"""Low-rank factor maths of an export: exact stacking of LoRA pieces, SVD with its truncation error.

A LoRA-wrapped layer's learned change ``ΔW`` (out × in) is written as one standard LoRA
``scale · B @ A``. When the change is a known sum of low-rank pieces on an unchanged base
(FedAvg-family adapters, FedLoRU's kept factors) the pieces are stacked: exact, rank Σ r_i.
Otherwise (the strategy changed the base: FRLoRA and its variants) ``ΔW`` is factored by SVD,
at its numerical rank (exact up to fp32 rounding) or truncated to a requested rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from fedllm.models.lowrank import relative_error

FP32_EPS = torch.finfo(torch.float32).eps


@dataclass
class LowRank:
    """One piece ``scale · B @ A`` of a layer's learned change (``B``: out × r, ``A``: r × in)."""

    B: torch.Tensor
    A: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        """Inner dimension r."""
        return int(self.B.shape[1])

    def product(self) -> torch.Tensor:
        """``scale · B @ A`` in float64."""
        return self.scale * (self.B.detach().double() @ self.A.detach().double())

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """``product()[:, start:stop]`` from those columns of ``A`` alone (each entry the same length-r float64 dot
        product, so bit for bit the same on the BLAS measured: MKL, tests/export/test_merged_columns.py)."""
        return self.scale * (self.B.detach().double() @ self.A.detach()[:, start:stop].double())

    def is_zero(self) -> bool:
        """True when the product is exactly zero (a factor is all zeros, e.g. right after a LoRA re-init)."""
        return not (bool(torch.any(self.B != 0)) and bool(torch.any(self.A != 0)))


@dataclass
class LayerFactors:
    """The exported LoRA of one layer and how faithful it is.

    Attributes:
        B: ``out × rank`` factor (float64).
        A: ``rank × in`` factor (float64).
        scale: LoRA scaling ``alpha / rank`` of the exported layer.
        exact_rank: rank needed to represent the change exactly.
        rel_error: ``‖ΔW − scale·B@A‖_F / ‖ΔW‖_F`` (0 for an exact stack, ~1e-7 for an exact SVD).
        method: ``stack`` (pieces concatenated) or ``svd``.
    """

    B: torch.Tensor
    A: torch.Tensor
    scale: float
    exact_rank: int
    rel_error: float
    method: str

    @property
    def rank(self) -> int:
        """Rank of the exported factors."""
        return int(self.B.shape[1])

    @property
    def alpha(self) -> float:
        """``lora_alpha`` that gives :attr:`scale` at :attr:`rank`."""
        return self.scale * self.rank

    @property
    def truncated(self) -> bool:
        """True when the export keeps fewer directions than the change has."""
        return self.rank < self.exact_rank


def stack(pieces: Sequence[LowRank], scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One LoRA with ``scale · B @ A == Σ_i s_i · B_i @ A_i``: ``B = [s_i/scale · B_i]``, ``A = [A_i]``.

    Args:
        pieces: The low-rank pieces (at least one).
        scale: Scaling of the stacked LoRA.

    Returns:
        ``(B, A)`` in float64, of rank ``Σ r_i``.
    """
    if not pieces:
        raise ValueError("stack of no pieces")
    B = torch.cat([p.B.detach().double() * (p.scale / scale) for p in pieces], dim=1)
    A = torch.cat([p.A.detach().double() for p in pieces], dim=0)
    return B, A


def factor_error(delta: torch.Tensor, B: torch.Tensor, A: torch.Tensor, scale: float) -> float:
    """``‖delta − scale·B@A‖_F / ‖delta‖_F`` (0 when both are zero)."""
    approx = scale * (B.double() @ A.double())
    if not bool(torch.any(delta != 0)):
        return 0.0 if not bool(torch.any(approx != 0)) else math.inf
    return relative_error(approx, delta)


def numerical_rank(singular: torch.Tensor, shape: tuple[int, int], magnitude: float) -> int:
    """Number of singular values above the rounding floor.

    The change is computed from fp32 weights of entries up to ``magnitude``; rounding them
    leaves noise of spectral norm about ``eps32 · magnitude · (√out + √in)``, which no
    learned direction can be told apart from.

    Args:
        singular: Singular values, descending.
        shape: ``(out, in)`` of the matrix.
        magnitude: Largest absolute entry of the weights the change was computed from.
    """
    if singular.numel() == 0:
        return 0
    rows, cols = shape
    floor = 4 * FP32_EPS * magnitude * (math.sqrt(rows) + math.sqrt(cols))
    svd_tol = max(rows, cols) * torch.finfo(singular.dtype).eps * float(singular[0])
    return int((singular > max(floor, svd_tol)).sum())


def svd_factors(delta: torch.Tensor, scale: float, max_rank: Optional[int], magnitude: float) -> LayerFactors:
    """Factor ``delta`` as ``scale · B @ A`` at its numerical rank, or at most ``max_rank``.

    Args:
        delta: The learned change (float64, out × in).
        scale: Scaling of the exported LoRA.
        max_rank: Truncate to this rank when the change needs more; None: exact.
        magnitude: Largest absolute weight entry (see :func:`numerical_rank`).

    Returns:
        The factors, with ``sqrt(S)`` split evenly between B and A.
    """
    U, S, Vh = torch.linalg.svd(delta, full_matrices=False)
    exact = numerical_rank(S, tuple(delta.shape), magnitude)
    keep = max(1, exact if max_rank is None else min(exact, max_rank))  # a zero change exports a zero rank-1 LoRA
    root = (S[:keep] / scale).sqrt()
    B = U[:, :keep] * root
    A = root[:, None] * Vh[:keep]
    return LayerFactors(B, A, scale, exact, factor_error(delta, B, A, scale), "svd")


def rounding_tolerance(magnitude: float, operations: int = 1) -> float:
    """Largest difference fp32 rounding can make to weights of entries up to ``magnitude`` over ``operations`` sums."""
    return 8 * FP32_EPS * magnitude * max(1, operations)


def layer_factors(original: torch.Tensor, effective: torch.Tensor, base_without_pieces: Optional[torch.Tensor],
                  pieces: Sequence[LowRank], scale: float, max_rank: Optional[int] = None) -> LayerFactors:
    """The exported LoRA of one layer: its learned change ``effective − original`` as ``scale · B @ A``.

    When the layer is its base plus known pieces and that base is still the original weight (up to
    fp32 rounding: FedAvg-family adapters, FedLoRU's kept or merged accumulations), the nonzero pieces
    are stacked exactly, unless that exceeds ``max_rank`` or the layer size. Otherwise (the strategy
    changed the base: FRLoRA and its variants; a term only observed) the change is factored by SVD.

    Args:
        original: The layer's weight in the original base model (out × in).
        effective: The layer's effective weight in the run's model (float64).
        base_without_pieces: ``effective − Σ pieces`` as the strategy holds it, or None when the pieces
            do not account for the layer.
        pieces: Adapter products and kept factors.
        scale: Scaling of the exported LoRA (the run's ``alpha / r``).
        max_rank: Upper bound on the exported rank; None: exact.
    """
    original = original.double()
    delta = effective.double() - original
    live = [p for p in pieces if not p.is_zero()]
    stacked = sum(p.rank for p in live)
    if base_without_pieces is not None and live and stacked <= min(delta.shape) and (
            max_rank is None or stacked <= max_rank):
        magnitude = max(float(original.abs().max()), float(base_without_pieces.abs().max()))
        drift = float((base_without_pieces.double() - original).abs().max())
        if drift <= rounding_tolerance(magnitude, 1 + len(pieces)):
            B, A = stack(live, scale)
            return LayerFactors(B, A, scale, stacked, factor_error(delta, B, A, scale), "stack")
    magnitude = max(float(original.abs().max()), float(effective.abs().max())) if original.numel() else 0.0
    return svd_factors(delta, scale, max_rank, magnitude)
