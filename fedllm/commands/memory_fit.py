"""The dry run's "fits" line: does one training process of the recipe fit a 24, 40 or 80 GB GPU, and if not, what
would make it fit.

The figure is the peak-memory estimate of :meth:`fedllm.commands.cost_report.CostReport.memory` for a step on a GPU
(SDPA / flash attention: no ``S x S`` weights kept), plus :data:`CUDA_RUNTIME_BYTES` for what the CUDA context and
its kernels hold outside PyTorch's allocator. A card's size is its memory in GiB (a "24 GB" card has 24 GiB); the line's GB are ``1024**3`` bytes, as the rest
of the dry run's.
When the smallest card is too small, each option the recipe can change is estimated alone —
``train.gradient_checkpointing: true``, ``model.quantization: 4bit``, a smaller ``train.batch_size`` with a
larger ``train.grad_accum`` (the same examples per optimizer step) — and the line names those that fit.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

#: GPU sizes the line answers for, in GiB.
GPU_GIB = (24, 40, 80)
#: The CUDA context, cuBLAS workspaces and loaded kernels, outside ``torch.cuda.max_memory_allocated``.
CUDA_RUNTIME_BYTES = 600 * 2**20


def gpu_bytes(costs: Any, recipe: Optional[Any] = None) -> int:
    """The estimated peak of one training process of ``recipe`` (default: the report's) on a GPU."""
    return sum(costs.memory("cuda", recipe).values()) + CUDA_RUNTIME_BYTES


def _verdict(need: int) -> str:
    return " / ".join("yes" if need <= g * 2**30 else "no" for g in GPU_GIB)


def _gb(n: int) -> str:
    return f"{n / 2**30:.1f} GB"


def options(recipe: Any) -> list[tuple[str, Any]]:
    """``(what to set, the recipe with it)`` for each option that lowers the peak and the recipe does not use yet."""
    out = []
    if not getattr(recipe.train, "gradient_checkpointing", False):
        out.append(("train.gradient_checkpointing: true", _with(recipe, "train", gradient_checkpointing=True)))
    if recipe.model.quantization not in ("4bit", "4bit-flowertune"):
        out.append(("model.quantization: 4bit", _with(recipe, "model", quantization="4bit")))
    batch, accum = recipe.train.batch_size, recipe.train.grad_accum
    while batch > 1:
        batch, accum = batch // 2, accum * 2
        out.append((f"train.batch_size: {batch} with grad_accum: {accum}",
                    _with(recipe, "train", batch_size=batch, grad_accum=accum)))
    return out


def _with(recipe: Any, section: str, **changes: Any) -> Any:
    r = copy.copy(recipe)
    part = copy.copy(getattr(r, section))
    for k, v in changes.items():
        setattr(part, k, v)
    setattr(r, section, part)
    return r


def fits_lines(costs: Any) -> list[str]:
    """``fits: 24 GB / 40 GB / 80 GB GPU: yes / no / no``, and the options that would make it fit the smallest."""
    need = gpu_bytes(costs)
    lines = [f"  fits: {' / '.join(f'{g} GB' for g in GPU_GIB)} GPU: {_verdict(need)} (on a GPU: {_gb(need)}, "
             f"including {_gb(CUDA_RUNTIME_BYTES)} for the CUDA context)"]
    if need <= GPU_GIB[0] * 2**30:
        return lines
    found, smallest = [], None
    for what, changed in options(costs.recipe):
        alt = gpu_bytes(costs, changed)
        if alt <= GPU_GIB[0] * 2**30:
            if what.startswith("train.batch_size"):  # the largest batch that fits is enough
                if smallest is not None:
                    continue
                smallest = what
            found.append(f"{what} ({_gb(alt)})")
    if found:
        lines.append(f"    to fit {GPU_GIB[0]} GB, any of: {'; '.join(found)}")
    else:
        lines.append(f"    no single option makes it fit {GPU_GIB[0]} GB (gradient checkpointing, 4-bit, a smaller "
                     "batch with grad_accum); combine them, or shorten train.max_length")
    return lines
