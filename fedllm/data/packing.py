"""Padding-free packing (``train.packing``): a micro-batch as one row of its sequences, end to end.

A right-padded micro-batch computes every padded position of every shorter example. A packed micro-batch holds
the same examples concatenated into one row (transformers' ``DataCollatorWithFlattening``): ``position_ids``
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


def pack_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A right-padded causal batch (:func:`fedllm.data.collate.collate`) as one packed row without its padding.

    Every runtime hands the client a padded batch; this drops each row's padding and packs the rows in order, so
    the packed row holds exactly the real tokens of the padded one.

    Raises:
        ValueError: a batch without ``attention_mask`` or with per-row labels (a classifier's).
    """
    mask, labels = batch.get("attention_mask"), batch.get("labels")
    if mask is None or labels is None or labels.dim() != 2:
        raise ValueError("train.packing packs causal-LM batches (input_ids, attention_mask, per-token labels)")
    lengths = mask.sum(dim=1).tolist()
    rows = [{"input_ids": batch["input_ids"][i, :n].tolist(), "labels": labels[i, :n].tolist()}
            for i, n in enumerate(lengths)]
    return pack_examples(rows)


def is_packed(batch: dict[str, Any]) -> bool:
    """Whether a batch is packed (one row of sequences told apart by ``position_ids``)."""
    return "position_ids" in batch and "attention_mask" not in batch


def sequence_index(position_ids: Any) -> Any:
    """The sequence each position of a packed row belongs to (0, 1, ...), from the restarts of its position ids."""
    return (position_ids == 0).long().cumsum(dim=-1) - 1
