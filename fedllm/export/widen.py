"""Save a model in a wider dtype than it is held in (a bf16 base exported as ``--dtype fp32``) without casting it whole.

``model.to(torch.float32).save_pretrained(out)`` holds the whole model in fp32 before it writes a byte: 27 GB for a
LLaMA-2-7B held in bf16 (13.5 GB), more than the machine that trained it. Here the model is saved as it is held, in
shards of at most :data:`SHARD_BYTES`, and each shard is then read, widened and rewritten on its own: the process
holds one widened shard beside the model. The files hold what the whole cast would have written (every floating
tensor widened, the rest as it was), with ``config.json``'s dtype and the shard index's ``total_size`` set to match.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

SHARD_BYTES = 2 * 2**30
"""Largest shard saved before widening (as held): a widened shard of an fp32 export of bf16 weights is 4 GiB."""

INDEX = "model.safetensors.index.json"


def widens(model: Any, dtype: torch.dtype) -> bool:
    """Whether casting ``model`` to ``dtype`` grows any of its floating tensors (parameters or buffers)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.is_floating_point() and t.element_size() < itemsize for t in tensors)


def save_widened(model: Any, out: Path, dtype: torch.dtype) -> None:
    """``model.to(dtype).save_pretrained(out)``'s files, written one shard at a time; ``model``'s tensors are left as
    they were (its config records ``dtype``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    model.save_pretrained(str(out), max_shard_size=SHARD_BYTES)
    total = 0
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as held:
            metadata = held.metadata()
            tensors = {name: _widened(held.get_tensor(name), dtype) for name in held.keys()}
        partial = path.with_name(path.name + ".widening")
        save_file(tensors, str(partial), metadata=metadata)
        os.replace(partial, path)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    index = out / INDEX
    if index.is_file():
        facts = json.loads(index.read_text())
        facts.setdefault("metadata", {})["total_size"] = total
        index.write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
    model.config.dtype = dtype  # as the cast model's save would have recorded it
    model.config.save_pretrained(str(out))


def _widened(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor
