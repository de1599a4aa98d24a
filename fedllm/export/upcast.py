"""Run a half-precision model's forward in fp32 one module at a time, without an fp32 copy of the whole model.

A merged export checks its merge in fp32 (:func:`fedllm.export.merged.check_probe`). Casting a bf16 base to fp32
for that doubles it (a 7B base: 13.5 GB more, more than the machine that trained it has). Under
:func:`computed_in_fp32` each module's own half-precision parameters and buffers are cast to fp32 just before its
forward and put back right after it, so the model computes what ``model.float()`` would, with one module's fp32
copy in memory at a time. Two kinds of module never hold a whole fp32 copy:

- an ``nn.Embedding`` looks its bf16 rows up and casts them (a lookup commutes with the cast: exact);
- an ``nn.Linear`` whose fp32 weight is above :data:`BLOCK_BYTES` (a 7B model's 32,000-row head: 500 MiB) computes
  its output features :data:`BLOCK_BYTES` of fp32 rows at a time. Each output is the same length-``in`` dot
  product: bit for bit the full product's on MKL at LLaMA-2-7B's shapes (32,000 x 4,096, 11,008 x 4,096 and
  4,096 x 11,008, blocks of 1,024 rows and more, 1 to 64 tokens), but BLAS may pick another kernel for a narrow
  block (16 rows of 128 columns differ in the last bits), so this is fp32 up to the rounding of a sum's order. The
  export's check compares two probes computed alike (:func:`fedllm.export.merged.check_probe`, tolerance 1e-4).

A module's weight can also be supplied from elsewhere (``weights``: the merged export's fp32 merged layers, kept on
disk, :mod:`fedllm.export.spill`): read just before its forward and dropped after it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
import torch.nn.functional as F

from fedllm.models.fp32_modules_to_save import hooks_as_cast_whole

HALF = (torch.bfloat16, torch.float16)
BLOCK_BYTES = 64 * 2**20
"""The largest fp32 weight block a Linear computes with at once under :func:`computed_in_fp32` (a 4096 x 4096
layer's whole weight)."""


def _own_half_tensors(module: torch.nn.Module) -> list[tuple[dict, str]]:
    """``(module._parameters or module._buffers, name)`` of the module's own half-precision tensors."""
    return [(store, name) for store in (module._parameters, module._buffers)
            for name, t in store.items() if t is not None and t.dtype in HALF]


def has_half(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is bf16 or fp16."""
    return any(_own_half_tensors(m) for m in model.modules())


def _blocked_linear(module: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward in fp32 from its half weight, :data:`BLOCK_BYTES` of fp32 rows at a time."""
    weight, bias = module.weight, module.bias
    rows = max(1, BLOCK_BYTES // (4 * weight.shape[1]))

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, weight[i:i + rows].float(), None if bias is None else bias[i:i + rows].float())
                          for i in range(0, weight.shape[0], rows)], dim=-1)

    return forward


def _looked_up(module: torch.nn.Embedding) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module``'s forward as fp32 rows of its half weight (the rows looked up, then cast)."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, module.weight, module.padding_idx, None, module.norm_type, module.scale_grad_by_freq,
                           module.sparse).float()

    return forward


def _forward_in_blocks(module: torch.nn.Module) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """A forward that needs no whole fp32 copy of ``module``'s half weight, for the plain modules that have one."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in HALF:
        return None
    if type(module) is torch.nn.Embedding and module.max_norm is None:  # max_norm renormalises the weight in place
        return _looked_up(module)
    if type(module) is torch.nn.Linear and weight.numel() * 4 > BLOCK_BYTES:
        return _blocked_linear(module)
    return None


@contextlib.contextmanager
def computed_in_fp32(model: torch.nn.Module,
                     weights: Optional[Mapping[torch.nn.Module, Callable[[], torch.Tensor]]] = None) -> Iterator[Any]:
    """Within the block, every forward of a module of ``model`` sees its own bf16/fp16 tensors as fp32 copies.

    The copies are made by a forward pre-hook and dropped by a forward hook that runs even when the forward raises,
    so afterwards the model holds exactly what it held before. Plain embeddings and large plain linears compute
    from their half weights without a whole fp32 copy (module docstring). ``weights``: ``{module: read}``, the fp32
    weight that module computes with instead of its own, read before its forward and dropped after it. The fp32
    ``modules_to_save`` copies' dtype hooks cast nothing meanwhile, as for a model cast whole
    (:func:`fedllm.models.fp32_modules_to_save.hooks_as_cast_whole`).
    """
    weights = weights or {}
    stashed: dict[int, list] = {}

    def upcast(module: torch.nn.Module, args: Any) -> None:
        kept = []
        read = weights.get(module)
        if read is not None:
            kept.append((module._parameters, "weight", module.weight.data))
            module.weight.data = read()
        for store, name in _own_half_tensors(module):
            t = store[name]
            kept.append((store, name, t.data))
            t.data = t.data.float()
        stashed.setdefault(id(module), []).append(kept)

    def restore(module: torch.nn.Module, args: Any, output: Any) -> None:
        for store, name, data in stashed[id(module)].pop():
            store[name].data = data

    handles, replaced = [], []
    try:
        for module in model.modules():
            forward = None if module in weights else _forward_in_blocks(module)
            if forward is not None:
                module.forward = forward  # an instance attribute: nn.Module.__call__ runs it
                replaced.append(module)
            elif module in weights or _own_half_tensors(module):
                handles.append(module.register_forward_pre_hook(upcast))
                handles.append(module.register_forward_hook(restore, always_call=True))
        with hooks_as_cast_whole():
            yield model
    finally:
        for handle in handles:
            handle.remove()
        for module in replaced:
            del module.forward
