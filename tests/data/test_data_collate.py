"""collate: right padding, attention mask, -100 label padding, classification labels."""

from __future__ import annotations

import pytest
import torch

from fedllm.data.collate import collate


def test_causal_padding():
    batch = collate([{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8], "labels": [8]}], pad_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[5, 6, 7], [8, 0, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [1, 0, 0]]))
    assert torch.equal(batch["labels"], torch.tensor([[-100, 6, 7], [8, -100, -100]]))
    assert all(t.dtype == torch.long for t in batch.values())


def test_classification_labels():
    batch = collate([{"input_ids": [1, 2], "label": 2}, {"input_ids": [3, 4, 5, 6], "label": 0}], 9, "classification")
    assert torch.equal(batch["input_ids"], torch.tensor([[1, 2, 9, 9], [3, 4, 5, 6]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    assert torch.equal(batch["labels"], torch.tensor([2, 0]))


def test_errors():
    with pytest.raises(ValueError, match="at least one"):
        collate([], 0)
    with pytest.raises(ValueError, match="unknown task"):
        collate([{"input_ids": [1], "labels": [1]}], 0, "seq2seq")
    with pytest.raises(ValueError, match="pad id"):
        collate([{"input_ids": [1], "labels": [1]}], None)
