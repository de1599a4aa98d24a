"""What a 4-bit or 8-bit base holds in memory beyond its quantised weights, and how fedllm drops it.

Two costs made a 4/8-bit LoRA step on a CPU take more memory than the same step on a bf16 base
(docs/memory.md, 4-bit and 8-bit bases):

- **The checkpoint file's pages.** transformers maps a safetensors file and the parameters bitsandbytes leaves
  unquantised (the embedding, the norms, an untied head) are views into that mapping. bitsandbytes read every
  linear layer's bf16 (or fp32) weights through it to quantise them, so while one view lives the whole file stays
  resident: SmolLM2-135M's 4-bit base held 270 MiB of file pages besides its 76 MiB of quantised weights, more
  than the bf16 base (whose weights are those pages). :func:`own_unquantised_weights` copies the unquantised
  parameters into the process's own memory, which releases the mapping.
- **The input every 8-bit layer keeps for backward.** bitsandbytes' LLM.int8() matmul (``MatMul8bitFp`` on a
  CPU, ``MatMul8bitLt`` on a GPU) stores its input on the autograd context whenever the input requires grad,
  although the input's gradient needs only the weight (a frozen base computes no weight gradient): each
  quantised layer's input, the MLP's ``intermediate_size``-wide one included, stays alive until backward, and,
  being a context attribute rather than a saved tensor, activation checkpointing cannot drop it either.
  :func:`int8_layers_keep_no_input` runs the layer's own forward without building its graph and computes the
  input's gradient as bitsandbytes' backward does (the int8 weight dequantised row-wise, the same matmul), so the
  output and the gradient are bitsandbytes' to the bit and nothing but the quantised weight is kept.

bitsandbytes' 4-bit matmul (``MatMul4Bit``) keeps only the packed weight and dequantises it again in backward,
so 4-bit layers need no change.
"""

from __future__ import annotations

import types
from typing import Any

import torch

QUANTIZED_PARAMETERS = ("Params4bit", "Int8Params")


def own_unquantised_weights(model: Any) -> None:
    """Copy every unquantised CPU parameter and buffer of ``model`` into memory of its own (tied parameters stay
    tied: the parameter object keeps its identity), so nothing refers to the loader's file mapping any more."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if tensor.device.type == "cpu" and type(tensor).__name__ not in QUANTIZED_PARAMETERS:
                tensor.data = tensor.data.clone()


class _Int8InputFreeMatmul(torch.autograd.Function):
    """``layer(x)`` for a frozen bitsandbytes ``Linear8bitLt``; backward: ``grad @ dequantised weight``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: Any, original: Any) -> torch.Tensor:
        with torch.no_grad():
            out = original(x)
        ctx.layer, ctx.x_shape, ctx.x_dtype = layer, x.shape, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        state = ctx.layer.state  # as bitsandbytes' MatMul8bitFp / MatMul8bitLt backward compute grad_A
        if grad.dim() == 3:
            grad = grad.reshape(-1, grad.shape[-1]).contiguous()
        weight = state.CB.to(ctx.x_dtype, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))
        return torch.matmul(grad.to(ctx.x_dtype), weight).view(ctx.x_shape), None, None


def _input_free_forward(layer: Any, x: torch.Tensor) -> torch.Tensor:
    original = types.MethodType(type(layer).forward, layer)
    frozen = not layer.weight.requires_grad and (layer.bias is None or not layer.bias.requires_grad)
    if not (frozen and torch.is_grad_enabled() and x.requires_grad):
        return original(x)
    if layer.weight.CB is not None:  # bitsandbytes moves the int8 weight into the layer's state on the first call
        layer.init_8bit_state()
    return _Int8InputFreeMatmul.apply(x, layer, original)


def int8_layers_keep_no_input(model: Any) -> int:
    """Give every bitsandbytes ``Linear8bitLt`` of ``model`` the forward of :class:`_Int8InputFreeMatmul` (the layer
    keeps its class, so what checks for it still finds it); returns how many layers changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ == "Linear8bitLt" and "forward" not in module.__dict__:
            module.forward = types.MethodType(_input_free_forward, module)
            changed += 1
    return changed
