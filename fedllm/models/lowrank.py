"""Low-rank maths shared by the merge-and-reinit strategies (FRLoRA, FedLoRU and their variants).

Everything here works on plain tensors in fp32, whatever the dtype the model keeps:

- :func:`truncated_svd` / :func:`principal_factors`: the top-``r`` singular triplets of a weight,
  exactly (``torch.linalg.svd``) or randomized (``torch.svd_lowrank``, seeded so every process
  that runs it with the same seed gets the same factors), and FRLoRA's split of them into LoRA
  factors ``B0 = U_r·diag(√(S_r/s))``, ``A0 = diag(√(S_r/s))·Vh_r`` so that ``s·B0·A0 = U_r S_r Vh_r``.
- :func:`dense_weight`: a layer's weight as an fp32 matrix, dequantised when the layer is a
  bitsandbytes 4/8-bit layer.
- :func:`add_to_weight_`: ``W ← W + ΔW`` computed in fp32 and stored back in the weight's dtype.
- :func:`lora_init_`: LoRA's standard initialisation (down factor random, up factor zero),
  drawn from an explicit generator instead of the global RNG.
- :func:`numerical_rank`: rank of a matrix up to a relative tolerance.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

SvdMethod = Literal["exact", "randomized"]
SVD_METHODS = ("exact", "randomized")
QUANTIZED_WEIGHTS = ("Params4bit", "Int8Params")


def truncated_svd(weight: torch.Tensor, rank: int, method: SvdMethod = "exact", niter: int = 4,
                  oversample: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``rank`` leading singular triplets ``(U_r, S_r, Vh_r)`` of ``weight`` (computed in fp32).

    Args:
        weight: an ``out × in`` matrix.
        rank: number of triplets (at most ``min(out, in)``).
        method: ``exact`` (full ``torch.linalg.svd``) or ``randomized`` (``torch.svd_lowrank``
            with ``rank + oversample`` probe vectors and ``niter`` subspace iterations).
        niter: subspace (power) iterations of the randomized method.
        oversample: extra probe vectors of the randomized method.
        seed: seeds the randomized method's Gaussian probe; the global RNG is left untouched.

    Returns:
        ``U_r`` (out × rank), ``S_r`` (rank,), ``Vh_r`` (rank × in), fp32, singular values descending.
    """
    if method not in SVD_METHODS:
        raise ValueError(f"svd method {method!r}; expected one of {SVD_METHODS}")
    w = weight.detach().float()
    if not 0 < rank <= min(w.shape):
        raise ValueError(f"rank {rank} is not in 1..{min(w.shape)} for a {tuple(w.shape)} matrix")
    if method == "exact":
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        return u[:, :rank], s[:rank], vh[:rank]
    q = min(rank + oversample, min(w.shape))
    devices = [w.device] if w.device.type != "cpu" else []
    with torch.random.fork_rng(devices=devices, device_type=w.device.type if devices else "cuda"):
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(w, q=q, niter=niter)
    return u[:, :rank], s[:rank], v[:, :rank].mT.contiguous()


def principal_factors(weight: torch.Tensor, rank: int, scale: float, method: SvdMethod = "exact",
                      niter: int = 4, oversample: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """FRLoRA's init (seed 001, Eq. 6 with the official code's division by ``s``): ``(B0, A0)``.

    ``B0 = U_r·diag(√(S_r/s))`` (out × r) and ``A0 = diag(√(S_r/s))·Vh_r`` (r × in), fp32, so that
    ``s·B0·A0`` is the best rank-``r`` approximation of ``weight`` (for the exact method).
    """
    u, s, vh = truncated_svd(weight, rank, method, niter, oversample, seed)
    root = torch.sqrt(s / scale)
    return (u * root).contiguous(), (root[:, None] * vh).contiguous()


def product(b: torch.Tensor, a: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``scale · B @ A`` in fp32."""
    return (b.detach().float() @ a.detach().float()) * scale


def is_quantized(layer: torch.nn.Module) -> bool:
    """True for a bitsandbytes 4-bit or 8-bit layer."""
    return type(getattr(layer, "weight", None)).__name__ in QUANTIZED_WEIGHTS


def dense_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A copy of ``layer``'s weight as an fp32 ``out × in`` matrix (dequantised for k-bit layers)."""
    weight = getattr(layer, "weight", None)
    if type(weight).__name__ == "Params4bit" and getattr(weight.quant_state, "packing_format_for_cpu", False):
        # bitsandbytes repacks 4-bit weights for its CPU kernel on the first eval forward; undo it on copies
        # (the inverse rewrites the quant state it is given in place).
        import copy

        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse, dequantize_4bit

        data, state = _convert_weight_packed_for_cpu_inverse(weight.data.clone(), copy.deepcopy(weight.quant_state))
        return dequantize_4bit(data, state).float()
    if type(weight).__name__ == "Int8Params":
        # LLM.int8 row-wise absmax: W = CB · SCB / 127 (read directly; peft's helper rewrites the layer's state)
        cb = weight.CB if getattr(weight, "CB", None) is not None else weight.data
        scb = weight.SCB if getattr(weight, "SCB", None) is not None else layer.state.SCB
        return cb.float() * (scb.float() / 127.0)[:, None]
    if is_quantized(layer):
        from peft.utils.integrations import dequantize_module_weight

        return dequantize_module_weight(layer).detach().float().clone()
    return layer.weight.detach().float().clone()


@torch.no_grad()
def add_to_weight_(layer: torch.nn.Module, delta: torch.Tensor) -> None:
    """``W ← W + delta``: the sum is taken in fp32 and stored in the weight's own dtype.

    Raises:
        TypeError: the layer is quantized (its weight cannot hold an exact sum; keep the change
            beside it in higher precision instead).
    """
    if is_quantized(layer):
        raise TypeError(f"{type(layer).__name__}: cannot merge into a quantized weight")
    w = layer.weight
    if w.shape != delta.shape:
        raise ValueError(f"weight shape {tuple(w.shape)} vs update {tuple(delta.shape)}")
    w.copy_((w.float() + delta.to(w.device, torch.float32)).to(w.dtype))


@torch.no_grad()
def lora_init_(down: torch.Tensor, up: torch.Tensor, init: str, generator: torch.Generator) -> None:
    """LoRA's standard init in place: ``down`` random, ``up`` zero, so ``up @ down == 0``.

    ``init="default"`` draws ``down`` like PEFT's ``init_lora_weights=True`` (Kaiming-uniform with
    ``a=√5``); ``"gaussian"`` draws ``N(0, 1/r²)`` like PEFT's ``"gaussian"`` (``r = down.shape[0]``).
    The values come from ``generator`` (created on the CPU), never from the global RNG.
    """
    values = torch.empty(down.shape, dtype=torch.float32)
    if init == "default":
        torch.nn.init.kaiming_uniform_(values, a=math.sqrt(5), generator=generator)
    elif init == "gaussian":
        torch.nn.init.normal_(values, std=1.0 / down.shape[0], generator=generator)
    else:
        raise ValueError(f"lora init {init!r}; expected 'default' or 'gaussian'")
    down.copy_(values)
    up.zero_()


def numerical_rank(matrix: torch.Tensor, rtol: float = 1e-4, atol: Optional[float] = None) -> int:
    """Number of singular values above ``max(atol, rtol · σ_max)`` (computed in fp64)."""
    s = torch.linalg.svdvals(matrix.detach().double())
    if s.numel() == 0 or float(s[0]) == 0.0:
        return 0
    threshold = max(float(atol or 0.0), rtol * float(s[0]))
    return int((s > threshold).sum())


def relative_error(approx: torch.Tensor, target: torch.Tensor) -> float:
    """``‖approx − target‖_F / ‖target‖_F`` in fp64."""
    t = target.detach().double()
    return float(torch.linalg.norm(approx.detach().double() - t) / torch.linalg.norm(t))


def orthogonal_refactor(b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(B', A')`` with ``B'·A' = B·A``, ``A'`` = the top right singular vectors of ``B·A`` (orthonormal rows) and
    ``B' = U·diag(S)`` (FedSVD's server step, Lee et al., NeurIPS 2025; the authors'
    ``reinit_lora``).

    Computed from QR factors, never from the dense ``out × in`` product: ``B = Q_B R_B``, ``Aᵀ = Q_A R_A``, so
    ``B·A = Q_B (R_B R_Aᵀ) Q_Aᵀ`` and the SVD of the ``r × r`` core ``R_B R_Aᵀ = u·diag(S)·vh`` gives ``U = Q_B u``,
    ``Vh = vh Q_Aᵀ``: the same singular triplets as ``torch.linalg.svd(B·A)`` (up to the sign of each pair), in
    fp32. When ``B·A`` has rank below ``r`` the extra rows of ``A'`` are still orthonormal, with ``S = 0``.
    """
    q_b, r_b = torch.linalg.qr(b.detach().float())
    q_a, r_a = torch.linalg.qr(a.detach().float().mT)
    u, s, vh = torch.linalg.svd(r_b @ r_a.mT)
    return ((q_b @ u) * s).contiguous(), (vh @ q_a.mT).contiguous()


def latent_factors(delta: torch.Tensor, rank: int, method: SvdMethod = "randomized", niter: int = 10,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LoRA-SB's factors of an update (Ponkshe et al. 2024, arXiv 2411.19557; the Fed-SB authors' ``find_and_initialize_grad``):
    ``(B, R, A) = (U_r, diag(S_r), Vh_r)`` of ``delta``, so ``B·R·A`` is its best rank-``r`` approximation (exactly so
    for ``method="exact"``; the authors use ``torch.svd_lowrank`` with ``q = r`` and ``niter = 10``: ``randomized``
    here with no oversampling). fp32."""
    u, s, vh = truncated_svd(delta, rank, method, niter=niter, oversample=0, seed=seed)
    return u.contiguous(), torch.diag(s), vh.contiguous()
