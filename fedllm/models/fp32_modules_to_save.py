"""Trainable ``modules_to_save`` copies (the classifier head) kept in fp32 under a bf16/fp16 base.

PEFT's ``get_peft_model`` upcasts the LoRA factors of a bf16/fp16 base to fp32 (``autocast_adapter_dtype``), but its
``ModulesToSaveWrapper`` deep-copies the wrapped module in the base's dtype, so AdamW would update the trained head in
bf16: an update below 2^-8 of a weight rounds away. Like the fp32 master weights of mixed-precision training
(Micikevicius et al., 2018, "Mixed Precision Training", §3.1), :func:`keep_modules_to_save_fp32` casts the trainable
copies to fp32 (the frozen ``original_module`` stays in the base's dtype), so their gradients, AdamW moments and
updates are fp32, and the checkpoints, uploads and adapter exports carry fp32 heads.

So that the copy runs wherever the model runs, each wrapper gets two forward hooks:

- before: floating inputs are cast to the dtype of the module the wrapper is about to run (the fp32 copy; the
  frozen original when the adapter is disabled) — except under ``torch.autocast``, which casts each op's inputs
  itself (the head's matmuls run in bf16 from the fp32 weights, as the LoRA factors' do, and opacus sees the same
  activations as for any other layer);
- after: a floating output is cast to the frozen original's dtype, so the rest of the model sees what the bf16 head
  gave it before (evaluation and generation run without autocast).

The hooks read the dtypes at each call: once a model is cast whole (an export upcasts it to fp32), they cast nothing.
Within :func:`hooks_as_cast_whole` they cast nothing either: a merged export computes a half-precision model in fp32
one module at a time (:func:`fedllm.export.upcast.computed_in_fp32`), so the frozen original stays bf16 in memory while
the model computes what ``model.float()`` would; the output cast would round the fp32 head's logits to bf16.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
_CAST_WHOLE = contextvars.ContextVar("fedllm_modules_to_save_cast_whole", default=False)


@contextlib.contextmanager
def hooks_as_cast_whole() -> Iterator[None]:
    """Within the block, the wrappers' hooks cast nothing, as for a model cast whole to fp32 (module docstring)."""
    token = _CAST_WHOLE.set(True)
    try:
        yield
    finally:
        _CAST_WHOLE.reset(token)


def _floating_dtype(module: torch.nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def _running_module(wrapper: Any) -> torch.nn.Module:
    """The module PEFT's ``ModulesToSaveWrapper.forward`` runs: the active adapter's copy, or the frozen original
    when adapters are disabled or this wrapper has no copy for the active adapter."""
    active = wrapper.active_adapters
    if wrapper.disable_adapters or not active or active[0] not in wrapper.modules_to_save:
        return wrapper.original_module
    return wrapper.modules_to_save[active[0]]


def _cast_inputs(wrapper: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if _CAST_WHOLE.get():
        return None  # unchanged
    dtype = _floating_dtype(_running_module(wrapper))

    def cast(x: Any) -> Any:
        if (dtype is None or not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dtype == dtype
                or torch.is_autocast_enabled(x.device.type)):
            return x
        return x.to(dtype)

    return tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}


def _cast_output(wrapper: Any, args: tuple, output: Any) -> Any:
    if _CAST_WHOLE.get():
        return None  # unchanged
    dtype = _floating_dtype(wrapper.original_module)
    if dtype is None or not isinstance(output, torch.Tensor) or not output.is_floating_point() or output.dtype == dtype:
        return None  # unchanged
    return output.to(dtype)


def keep_modules_to_save_fp32(model: torch.nn.Module) -> list[str]:
    """Cast every bf16/fp16 trainable ``modules_to_save`` copy of a PEFT model to fp32, in place, and hook its
    wrapper (module docstring); returns the wrappers' names (empty for an fp32 model: nothing changes)."""
    from peft.utils.other import ModulesToSaveWrapper

    upcast = []
    for name, wrapper in model.named_modules():
        if not isinstance(wrapper, ModulesToSaveWrapper):
            continue
        copies = [c for c in wrapper.modules_to_save.values() if _floating_dtype(c) in LOW_PRECISION]
        if not copies:
            continue
        for copy in copies:
            copy.to(torch.float32)  # floating parameters and buffers only; the Parameter objects are kept
        wrapper.register_forward_pre_hook(_cast_inputs, with_kwargs=True)
        wrapper.register_forward_hook(_cast_output)
        upcast.append(name)
    return upcast
