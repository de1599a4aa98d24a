"""Stochastic, unbiased quantisation of floats to integers in ``[0, L]`` and the dequantised (weighted) sum.

A value ``x`` is clipped to ``[−r, r]``, mapped to ``y = (x + r) / Δ ∈ [0, L]`` with ``Δ = 2r / L``, ``L = 2^b − 1``,
and rounded to ``⌊y⌋ + 1`` with probability ``y − ⌊y⌋``, else ``⌊y⌋``: ``E[q] = y``, so ``E[q·Δ − r] = x``
(unbiased) and ``|q·Δ − r − x| < Δ`` always. Summed with integer weights ``w_k`` and dequantised
(:func:`dequantize_sum`), the weighted mean of the clients' values is off by less than ``Δ`` per coordinate, with
mean 0 and standard deviation at most ``(Δ/2)·√(Σ w_k²)/Σ w_k`` (``Δ/(2√n)`` for equal weights). Values beyond
``[−r, r]`` are clipped first: pick ``r`` above the largest update coordinate (:func:`clipped_count` reports them).
"""

from __future__ import annotations

import numpy as np

from fedllm.privacy.secagg.params import SecAggParams


def word_dtype(params: SecAggParams) -> np.dtype:
    """The unsigned integer type of one value modulo ``2^mod_bits``."""
    return np.dtype(np.uint32 if params.mod_bits == 32 else np.uint64)


def clipped_count(values: np.ndarray, params: SecAggParams) -> int:
    """How many of ``values`` lie outside ``[−r, r]`` (they are clipped: a biased error beyond the bound)."""
    return int(np.count_nonzero(np.abs(values) > params.quantization_range))


def quantize(values: np.ndarray, params: SecAggParams, rng: np.random.Generator) -> np.ndarray:
    """``values`` (float) as integers in ``[0, L]`` of the word type, rounded stochastically (unbiased)."""
    r = params.quantization_range
    y = (np.clip(np.asarray(values, dtype=np.float64), -r, r) + r) / params.step
    low = np.floor(y)
    q = low + (rng.random(y.shape) < (y - low))
    return np.minimum(q, params.levels).astype(word_dtype(params))


def dequantize_sum(total: np.ndarray, weight: int, params: SecAggParams) -> np.ndarray:
    """``Σ_k w_k·x_k`` (float64) from ``total = Σ_k w_k·q_k mod 2^mod_bits`` and ``weight = Σ_k w_k``.

    Exact integer sums require :meth:`SecAggParams.fits` of ``weight``; then
    ``Σ w_k (q_k Δ − r) = Δ·total − r·weight``.
    """
    return total.astype(np.float64) * params.step - params.quantization_range * weight
