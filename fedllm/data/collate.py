"""Batch tokenized examples into padded tensors."""

from __future__ import annotations

import sys
import types
from typing import Callable

import torch

from fedllm.data.tokens import IGNORE_INDEX


def _pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _mask(examples: list[dict]) -> torch.Tensor:
    return _pad([[1] * len(ex["input_ids"]) for ex in examples], 0)


def _causal_labels(examples: list[dict]) -> torch.Tensor:
    return _pad([ex["labels"] for ex in examples], IGNORE_INDEX)


def _class_labels(examples: list[dict]) -> torch.Tensor:
    return torch.tensor([int(ex["label"]) for ex in examples], dtype=torch.long)


#: Task -> how the ``labels`` tensor is built.
LABELS: dict[str, Callable[[list[dict]], torch.Tensor]] = {
    "causal_lm": _causal_labels,
    "classification": _class_labels,
}


def pair_rows(examples: list[dict]) -> list[dict]:
    """Preference examples as ``2B`` causal rows: the ``B`` chosen sequences, then the ``B`` rejected ones (trl's
    concatenated batch)."""
    chosen = [{"input_ids": ex["input_ids"], "labels": ex["labels"]} for ex in examples]
    rejected = [{"input_ids": ex["rejected_input_ids"], "labels": ex["rejected_labels"]} for ex in examples]
    return chosen + rejected


def _pair_batch(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    rows = pair_rows(examples)
    batch = {"input_ids": _pad([r["input_ids"] for r in rows], int(pad_id)), "attention_mask": _mask(rows),
             "labels": _causal_labels(rows)}
    if all("ref_chosen_logp" in ex for ex in examples):
        batch["ref_logps"] = torch.tensor([ex["ref_chosen_logp"] for ex in examples]
                                          + [ex["ref_rejected_logp"] for ex in examples], dtype=torch.float32)
    return batch


def is_pair_batch(batch: dict[str, torch.Tensor]) -> bool:
    """Whether a collated batch holds preference pairs (see :func:`collate`)."""
    return "pairs" in batch


def collate(examples: list[dict], pad_id: int, task: str = "causal_lm") -> dict[str, torch.Tensor]:
    """Right-pad examples to the longest one in the batch.

    Preference examples (``rejected_input_ids``; :mod:`fedllm.data.preference`) become ``2B`` causal rows, the
    chosen sequences first (:func:`pair_rows`), with ``pairs`` (the ``B``) and, when the examples carry them,
    ``ref_logps`` (``2B`` reference log-probabilities in the same order, float32).

    Args:
        examples: Examples from :mod:`fedllm.data.formats`.
        pad_id: Id written into padded ``input_ids`` positions.
        task: ``causal_lm`` (per-token ``labels`` padded with -100) or
            ``classification`` (one integer ``labels`` entry per example).

    Returns:
        ``input_ids`` and ``attention_mask`` (batch x longest) and ``labels``
        (batch x longest, or batch), all ``torch.long``.

    Raises:
        ValueError: No examples, an unknown task or no pad id.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    if task not in LABELS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(LABELS)}")
    if pad_id is None:
        raise ValueError("collate needs a pad id (the tokenizer has no pad token; set one, e.g. the EOS token)")
    if "rejected_input_ids" in examples[0]:
        return {**_pair_batch(examples, pad_id), "pairs": torch.tensor(len(examples))}
    return {
        "input_ids": _pad([ex["input_ids"] for ex in examples], int(pad_id)),
        "attention_mask": _mask(examples),
        "labels": LABELS[task](examples),
    }


class _CallableModule(types.ModuleType):
    """``fedllm.data.collate`` names both this module and its function: the package exports the function lazily,
    but once this module is imported first (``from fedllm.data.collate import ...``) the package attribute is the
    module. Calling the module collates, so ``from fedllm.data import collate`` works in any import order."""

    def __call__(self, *args, **kwargs):
        return collate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
