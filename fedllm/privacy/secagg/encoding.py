"""A client's upload as one vector of words, and the unmasked sum back as keyed tensors.

The client encodes its *change* ``δ_k = upload_k − reference`` (``reference``: the state it was sent; 0 for a key
it was not sent, e.g. SCAFFOLD's control-variate change), key by key in sorted order, quantised
(:mod:`.quantize`) and multiplied by its integer weight ``w_k`` for the keys the strategy averages with weights;
the other keys are summed unweighted. Three words follow: ``w_k``, 1 and the number of the client's values that
were clipped to the quantisation range, so the sum carries ``Σ w_k``, the number of clients summed and the total
clipped (never one client's). The server decodes ``Σ_k w_k δ_k`` (weighted keys) and ``Σ_k δ_k`` (the others).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedllm.privacy.secagg.params import SecAggError, SecAggParams
from fedllm.privacy.secagg.quantize import clipped_count, dequantize_sum, quantize, word_dtype

StateDict = dict[str, torch.Tensor]
TRAILER = 3  # weight, 1, clipped values


@dataclass(frozen=True)
class Layout:
    """Which keys an upload holds, their shapes, and whether each is weighted (public: the server knows it)."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    weighted: tuple[bool, ...]

    @property
    def size(self) -> int:
        """Words of an encoded upload (values, then the weight, the count and the clipped values)."""
        return sum(int(np.prod(s)) for s in self.shapes) + TRAILER


def layout_of(state: StateDict, weighted_key) -> Layout:
    """The layout of uploads shaped like ``state``; ``weighted_key(name)`` says whether a key is weighted."""
    keys = tuple(sorted(state))
    return Layout(keys, tuple(tuple(state[k].shape) for k in keys), tuple(bool(weighted_key(k)) for k in keys))


def encode(
    upload: StateDict, reference: StateDict, weight: int, layout: Layout, params: SecAggParams, rng: np.random.Generator
) -> tuple[np.ndarray, int]:
    """The client's words (``w·q(δ)`` / ``q(δ)`` per key, then ``w``, 1, clipped) and how many values were clipped."""
    if sorted(upload) != list(layout.keys):
        raise SecAggError(f"the upload's keys {sorted(upload)} differ from the round's layout {list(layout.keys)}")
    if not (isinstance(weight, int) and weight >= 0):
        raise SecAggError(f"a secure-aggregation weight is a non-negative integer, got {weight!r}")
    dtype, parts, clipped = word_dtype(params), [], 0
    for key, shape, weighted in zip(layout.keys, layout.shapes, layout.weighted, strict=True):
        value = upload[key].detach().to("cpu", torch.float64)
        if tuple(value.shape) != shape:
            raise SecAggError(f"{key}: shape {tuple(value.shape)}, the layout says {shape}")
        if key in reference:
            value = value - reference[key].detach().to("cpu", torch.float64)
        delta = value.reshape(-1).numpy()
        clipped += clipped_count(delta, params)
        q = quantize(delta, params, rng)
        parts.append((q.astype(np.uint64) * np.uint64(weight)).astype(dtype) if weighted else q)
    parts.append(np.array([weight, 1, clipped], dtype=dtype))
    return np.concatenate(parts), clipped


@dataclass
class DecodedSum:
    """The unmasked sum: ``Σ_k w_k δ_k`` (weighted keys) or ``Σ_k δ_k`` (the others), ``Σ_k w_k``, the count and
    the values clipped to the range (all clients together)."""

    sums: dict[str, torch.Tensor]  # float64
    weight: int
    count: int
    clipped: int = 0

    def means(self, layout: Layout) -> StateDict:
        """``Σ w δ / Σ w`` for weighted keys, ``Σ δ / count`` for the others (float64)."""
        return {
            k: v / (self.weight if w else self.count)
            for k, v, w in zip(layout.keys, (self.sums[k] for k in layout.keys), layout.weighted, strict=True)
        }


def decode(total: np.ndarray, layout: Layout, params: SecAggParams) -> DecodedSum:
    """Inverse of summed :func:`encode` outputs (exact when :meth:`SecAggParams.fits` the total weight)."""
    if total.size != layout.size:
        raise SecAggError(f"the unmasked sum has {total.size} words, the layout {layout.size}")
    weight, count, clipped = (int(x) for x in total[-TRAILER:])
    if count == 0 or weight == 0 or not params.fits(max(weight, count)):
        raise SecAggError(
            f"the unmasked sum's weight {weight} over {count} clients is out of range for "
            f"{params.quantization_bits}-bit values modulo 2^{params.mod_bits}"
        )
    sums, offset = {}, 0
    for key, shape, weighted in zip(layout.keys, layout.shapes, layout.weighted, strict=True):
        n = int(np.prod(shape))
        sums[key] = torch.from_numpy(
            dequantize_sum(total[offset : offset + n], weight if weighted else count, params)
        ).reshape(shape)
        offset += n
    return DecodedSum(sums, weight, count, clipped)
