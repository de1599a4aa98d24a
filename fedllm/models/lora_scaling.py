"""LoRA's scaling applied to the rank-r activation instead of the layer's output, bit for bit (training only).

A LoRA linear layer computes ``y = W x + B (A x) · s`` with ``s = alpha / r`` (Hu et al. 2021, §4.1, Eq. 3). PEFT
multiplies the ``tokens x out`` product by ``s``, forward and backward; multiplying the ``tokens x r`` activation
``A x`` instead (``B ((A x) · s)``) does the same arithmetic on an ``out / r``-times smaller tensor: for SmolLM2's
q/o projections 576 / 8 = 72 times. When ``s`` is a power of two, a product by ``s`` is exact in binary floating
point (the exponent moves, the significand does not), so both orders give the same bits in the output and in every
gradient, in fp32 and in bf16 (``tests/training/test_lora_scaling.py``; an overflow, or products so small that they
are subnormal in one order and not in the other, aside). Other scalings (below 1, not a power of two) keep PEFT's
order.

Measured on one SmolLM2-135M bf16 client step (``python bench/bf16_step.py --threads 1``, docs/performance.md).
"""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any

import torch


def exact_scaling(s: Any) -> bool:
    """Whether ``s`` is a power of two ≥ 1, so that ``x · s`` is exact in binary floating point (an overflow aside;
    a power below 1 could round a subnormal)."""
    return isinstance(s, (int, float)) and s >= 1 and math.frexp(s)[0] == 0.5


def _scaled_rank_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """PEFT's ``lora.Linear.forward`` for one plain LoRA adapter, with ``s`` moved onto ``A x``; anything else
    (adapters off or merged, several active adapters, extra arguments such as mixed-adapter batches, a LoRA variant
    such as DoRA, a scaling changed since entering) goes to PEFT's own forward."""
    adapters = self.active_adapters
    name = adapters[0] if len(adapters) == 1 else None
    if (name is None or args or kwargs or self.disable_adapters or self.merged or name not in self.lora_A
            or name in self.lora_variant or not exact_scaling(self.scaling[name])):
        return type(self).forward(self, x, *args, **kwargs)
    result = self.base_layer(x)
    lora_a = self.lora_A[name]
    h = lora_a(self.lora_dropout[name](self._cast_input_dtype(x, lora_a.weight.dtype)))
    return (result + self.lora_B[name](h * self.scaling[name])).to(result.dtype)


@contextlib.contextmanager
def scaling_on_rank(model: torch.nn.Module, active: bool = True):
    """Context: every PEFT LoRA ``Linear`` of ``model`` whose scaling is a power of two computes ``B ((A x) · s)``
    (:func:`_scaled_rank_forward`); PEFT's forward again on exit."""
    if not active:
        yield
        return
    from peft.tuners.lora.layer import Linear

    layers = [m for m in model.modules() if type(m) is Linear
              and all(exact_scaling(s) for s in m.scaling.values()) and "forward" not in vars(m)]
    for m in layers:
        m.forward = types.MethodType(_scaled_rank_forward, m)
    try:
        yield
    finally:
        for m in layers:
            del m.forward
