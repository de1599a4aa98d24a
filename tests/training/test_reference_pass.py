"""DPO's reference pass (fedllm.engine.reference): one length-sorted pass over every client's pairs, small clients
sharing batches, gives each pair the log-probabilities it has computed alone (fp32: within 1e-6 relative)."""

from __future__ import annotations

import functools

import torch

from fedllm.data.collate import collate
from fedllm.engine.reference import compute_reference, compute_references
from fedllm.models.loading import load_model
from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig


def _pairs(n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pairs of very different lengths: prompt 2-30 tokens, answers 1-25 (labels -100 on the prompt)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(3, vocab, (int(torch.randint(2, 31, (1,), generator=gen)),), generator=gen).tolist()
        rows = []
        for _ in range(2):
            answer = torch.randint(3, vocab, (int(torch.randint(1, 26, (1,), generator=gen)),), generator=gen)
            rows.append((prompt + answer.tolist(), [-100] * len(prompt) + answer.tolist()))
        out.append({"input_ids": rows[0][0], "labels": rows[0][1],
                    "rejected_input_ids": rows[1][0], "rejected_labels": rows[1][1]})
    return out


def test_one_sorted_pass_equals_each_pair_alone_in_fp32():
    loaded = load_model(ModelConfig(name="tiny-llama", dtype="fp32"), LoraConfig(r=4, alpha=8), seed=0)
    model, pad = loaded.model, loaded.tokenizer.pad_token_id
    with torch.no_grad():  # a non-zero adapter, so the LoRA path counts
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    examples = _pairs(23, model.config.vocab_size)
    clients = {0: [3, 0, 7, 11, 1], 1: [2], 2: list(range(12, 23)) + [4, 5, 6, 8, 9, 10]}
    cfg = TrainConfig(local_steps=1, objective="dpo", batch_size=4, dtype="fp32")
    batch = functools.partial(collate, pad_id=pad)
    tables = compute_references(model, examples, clients, cfg, batch)
    assert {c: t.shape for c, t in tables.items()} == {0: (5, 2), 1: (1, 2), 2: (17, 2)}
    seen = []
    for c, indices in clients.items():
        alone = compute_reference(model, examples, indices, cfg, batch, batch_size=1)
        torch.testing.assert_close(tables[c], alone, rtol=1e-6, atol=0)
        seen += alone.flatten().tolist()
    assert len(set(seen)) == len(seen)  # every pair's row is its own (a swapped row would not be close)
