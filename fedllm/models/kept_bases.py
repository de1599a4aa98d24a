"""Base models kept in memory by a process that builds several federations of the same model.

The Flower node worker (:func:`fedllm.flower.runtime.serve_clientapps`) builds a federation for every run it serves;
a new run of the same model would load the base from disk again (parse the GGUF or safetensors, build the modules:
seconds of CPU per node and run). With :func:`keep` on, :func:`fedllm.models.loading.load_base_model` keeps an
untouched copy of the last base it loaded and hands a deep copy of it to the next build of the same model
(same ``model`` section after defaults, same number of labels and seed): the same tensors, bit for bit, that a load
from disk gives. Everything a recipe changes beyond the base (tokenizer options, data, LoRA, strategy) is still built
for each run. Not kept: quantized bases (bitsandbytes modules), bases spread by ``device_map``, and bases larger than
:data:`LIMIT_BYTES` (the copy doubles the base's memory).
"""

from __future__ import annotations

import copy
from typing import Any

LIMIT_BYTES = 2 * 2**30
"""The largest base kept (parameters and buffers): SmolLM2-135M in fp32 is 0.5 GiB."""

_kept: dict[str, Any] | None = None  # None: off (every other process); else at most one base, by key
hits = 0  # how many bases were handed out from memory (a test checks a second run's build used one)


def keep(enabled: bool = True) -> None:
    """Start (or stop) keeping bases in this process."""
    global _kept
    _kept = {} if enabled else None


def _key(cfg: Any, num_labels: int, seed: int) -> str:
    return repr((cfg, num_labels, seed))


def lookup(cfg: Any, num_labels: int, seed: int) -> Any | None:
    """A copy of the kept base for this model, or None (none kept, or keeping is off)."""
    global hits
    base = None if _kept is None else _kept.get(_key(cfg, num_labels, seed))
    if base is None:
        return None
    hits += 1
    return copy.deepcopy(base)


def remember(cfg: Any, num_labels: int, seed: int, model: Any) -> None:
    """Keep an untouched copy of ``model``, just loaded for ``cfg`` (replacing any other base), when keeping is on and
    the model is kept (module docstring)."""
    if _kept is None or cfg.quantization != "none" or cfg.device_map not in (None, "cpu"):
        return
    size = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    _kept.clear()
    if size <= LIMIT_BYTES:
        _kept[_key(cfg, num_labels, seed)] = copy.deepcopy(model)
