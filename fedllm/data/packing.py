"""Padding-free packing (``train.packing``): a micro-batch as one row of its sequences, end to end.

A right-padded micro-batch computes every padded position of every shorter example. A packed micro-batch holds
the same examples concatenated (transformers' ``DataCollatorWithFlattening``), in one row for flash-attention's
variable-length kernel, else in rows of at most ``train.max_length`` positions (a dense kernel computes the square
of each row, masked: several short rows cost less than one long one): ``position_ids``
restart at 0 at each sequence, and the first label of each sequence is ``-100``, so the last token of one
sequence never predicts the first token of the next. With no ``attention_mask`` and no cache, transformers reads
the restarts as sequence boundaries (``masking_utils.find_packed_sequence_indices``) and builds a block-diagonal
causal mask for SDPA and eager attention; flash-attention 2 takes its variable-length kernel from the same
position ids (a batch of one row). No token attends across sequences, every sequence is rotated from position 0,
and the loss, the mean over the micro-batch's supervised tokens, has the same terms as the padded batch's
(``tests/training/test_packing.py``: per-sequence losses and LoRA gradients equal the padded ones in fp32).

The model must be called without a cache (``use_cache=False``): a cache turns the detection off and the packed
sequences would silently attend to each other.
"""

from __future__ import annotations

from typing import Any

from fedllm.data.tokens import IGNORE_INDEX

#: Model types whose decoder builds its mask through transformers' ``create_causal_mask`` /
#: ``create_sliding_window_causal_mask`` with the ``position_ids`` (checked: packed logits equal the unpacked
#: ones under SDPA and eager, sliding windows included, transformers 5.24).
PACKING_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3",
                                 "olmo2"})


def _flattening() -> Any:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt", separator_id=IGNORE_INDEX)


def pack_examples(examples: list[dict]) -> dict[str, Any]:
    """Examples (``input_ids``, ``labels``) as one packed row: ``input_ids``, ``labels`` and ``position_ids``
    (1 x total length, ``torch.long``)."""
    if not examples:
        raise ValueError("packing needs at least one example")
    return _flattening()([{"input_ids": ex["input_ids"], "labels": ex["labels"]} for ex in examples])


def fill_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """Example indices per row, balanced: the fewest rows of at most ``capacity`` positions (at least the longest
    example) that longest-first onto the currently shortest row fills (Graham's LPT rule), so the rows end close
    together and their padded ends stay short; each row's indices in batch order. Deterministic."""
    capacity = max(capacity, *lengths)
    order = sorted(range(len(lengths)), key=lambda j: (-lengths[j], j))
    count = -(-sum(lengths) // capacity)
    while True:  # ends: with one example per row no row is over capacity
        rows: list[list[int]] = [[] for _ in range(count)]
        load = [0] * count
        for i in order:
            r = min(range(count), key=lambda j: (load[j], j))
            rows[r].append(i)
            load[r] += lengths[i]
        if max(load) <= capacity:
            return [sorted(r) for r in rows]
        count += 1


def _padded_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Packed rows to one tensor per key: a shorter row ends in padding that is a sequence of its own (positions
    0, 1, ..., label -100, token 0), so it attends to nothing real and nothing real attends to it."""
    import torch

    width = max(r["input_ids"].shape[1] for r in rows)
    out: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
    for r in rows:
        tail = width - r["input_ids"].shape[1]
        fill = {"input_ids": torch.zeros(1, tail, dtype=torch.long),
                "labels": torch.full((1, tail), IGNORE_INDEX, dtype=torch.long),
                "position_ids": torch.arange(tail, dtype=torch.long)[None]}
        for key, parts in out.items():
            parts.append(torch.cat([r[key], fill[key]], dim=1))
    return {key: torch.cat(parts) for key, parts in out.items()}


def pack_batch(batch: dict[str, Any], row_length: int | None = None) -> dict[str, Any]:
    """A right-padded causal batch (:func:`fedllm.data.collate.collate`) packed without its padding.

    Every runtime hands the client a padded batch; this drops each row's padding and lays the examples end to end:
    in one row (``row_length`` None: flash-attention's variable-length kernel needs one), or in balanced rows of at
    most ``row_length`` positions (:func:`fill_rows`), the shorter rows ending in a
    padding sequence of their own: a dense attention kernel computes the square of each row, so shorter rows cost
    less attention than one long row.

    Raises:
        ValueError: a batch without ``attention_mask`` or with per-row labels (a classifier's).
    """
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    if mask is None or labels is None or labels.dim() != 2:
        raise ValueError("train.packing packs causal-LM batches (input_ids, attention_mask, per-token labels)")
    lengths = mask.sum(dim=1).tolist()
    examples = [{"input_ids": batch["input_ids"][i, :n].tolist(), "labels": labels[i, :n].tolist()}
                for i, n in enumerate(lengths)]
    if row_length is None:
        return pack_examples(examples)
    return _padded_rows([pack_examples([examples[i] for i in row]) for row in fill_rows(lengths, row_length)])


def sequence_index(position_ids: Any) -> Any:
    """The sequence each position of a packed row belongs to (0, 1, ... per row), from its position ids' restarts."""
    return (position_ids == 0).long().cumsum(dim=-1) - 1
