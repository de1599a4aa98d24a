"""Run a half-precision model's forward in fp32 one module at a time, without an fp32 copy of the whole model.

A merged export checks its merge in fp32 (:func:`fedllm.export.merged.check_probe`). Casting a bf16 base to fp32
for that doubles it (a 7B base: 13.5 GB more, more than the machine that trained it has). Under
:func:`computed_in_fp32` each module's own half-precision parameters and buffers are cast to fp32 just before its
forward and put back right after it, so the model computes exactly what ``model.float()`` would, with one module's
fp32 copy in memory at a time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from fedllm.models.fp32_modules_to_save import hooks_as_cast_whole

HALF = (torch.bfloat16, torch.float16)


def _own_half_tensors(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """``(module._parameters or module._buffers, name)`` of the module's own half-precision tensors."""
    return [(store, name) for store in (module._parameters, module._buffers)
            for name, t in store.items() if t is not None and t.dtype in HALF]


def has_half(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is bf16 or fp16."""
    return any(_own_half_tensors(m) for m in model.modules())


@contextlib.contextmanager
def computed_in_fp32(model: torch.nn.Module) -> Iterator[Any]:
    """Within the block, every forward of a module of ``model`` sees its own bf16/fp16 tensors as fp32 copies.

    The copies are made by a forward pre-hook and dropped by a forward hook that runs even when the forward raises,
    so afterwards the model holds exactly what it held before. The fp32 ``modules_to_save`` copies' dtype hooks cast
    nothing meanwhile, as for a model cast whole (:func:`fedllm.models.fp32_modules_to_save.hooks_as_cast_whole`).
    """
    stashed: dict[int, list] = {}

    def upcast(module: torch.nn.Module, args: Any) -> None:
        kept = []
        for store, name in _own_half_tensors(module):
            t = store[name]
            kept.append((store, name, t.data))
            t.data = t.data.float()
        stashed.setdefault(id(module), []).append(kept)

    def restore(module: torch.nn.Module, args: Any, output: Any) -> None:
        for store, name, data in stashed[id(module)].pop():
            store[name].data = data

    handles = []
    try:
        for module in model.modules():
            if _own_half_tensors(module):
                handles.append(module.register_forward_pre_hook(upcast))
                handles.append(module.register_forward_hook(restore, always_call=True))
        with hooks_as_cast_whole():
            yield model
    finally:
        for handle in handles:
            handle.remove()
