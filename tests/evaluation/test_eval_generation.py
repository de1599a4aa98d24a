"""Batched greedy generation: left padding, new tokens only, eos/stop handling, state restored."""

import torch

from fedllm.evaluation.generation import generate, generate_completions

PROMPTS = [
    "Question: Tom has 3 apples. Answer:",
    "Hi",
    "Compose an engaging travel blog post about a recent trip to Hawaii, with many words in it.",
    "The answer is",
    "1 2 3",
]


def test_batched_equals_one_by_one_and_restores_state(tiny_lm, tokenizer):
    tiny_lm.train()
    tokenizer.padding_side = "right"
    one = [generate(tiny_lm, tokenizer, [p], max_new_tokens=6, batch_size=1, progress=False)[0] for p in PROMPTS]
    batched = generate(tiny_lm, tokenizer, PROMPTS, max_new_tokens=6, batch_size=8, progress=False)
    assert batched == one
    assert tiny_lm.training and tokenizer.padding_side == "right"


def test_only_new_tokens_limit_and_order(tiny_lm, tokenizer):
    comps = generate_completions(tiny_lm, tokenizer, PROMPTS, max_new_tokens=4, batch_size=2, progress=False)
    assert len(comps) == len(PROMPTS)
    for prompt, comp in zip(PROMPTS, comps):
        assert comp.completion_tokens <= 4
        assert comp.prompt_tokens == len(tokenizer(prompt)["input_ids"])
        assert prompt not in comp.text
        assert comp.finish_reason in ("stop", "length")


def test_stops_at_eos_and_at_stop_strings(scripted_lm, tokenizer):
    model = scripted_lm({"Tom": "The answer is 7.\nQuestion: next one"})
    text = generate(model, tokenizer, ["Question: Tom? Answer:"], max_new_tokens=50, batch_size=1,
                    progress=False, stop=["\nQuestion:"])[0]
    assert text == "The answer is 7."
    full = generate(model, tokenizer, ["Question: Tom? Answer:"], max_new_tokens=50, batch_size=1, progress=False)[0]
    assert full == "The answer is 7.\nQuestion: next one"  # cut at eos, nothing after it


def test_callback_sees_every_prompt_once(tiny_lm, tokenizer):
    seen = []
    generate(tiny_lm, tokenizer, PROMPTS, max_new_tokens=2, batch_size=2, progress=False,
             on_batch=lambda idx, outs: seen.extend(idx))
    assert sorted(seen) == list(range(len(PROMPTS)))


def test_pad_token_restored_when_missing(tiny_lm, tokenizer):
    tokenizer.pad_token = None
    generate(tiny_lm, tokenizer, PROMPTS[:2], max_new_tokens=2, batch_size=2, progress=False)
    assert tokenizer.pad_token is None


def test_sampling_path_runs(tiny_lm, tokenizer):
    torch.manual_seed(0)
    comps = generate_completions(tiny_lm, tokenizer, PROMPTS[:2], max_new_tokens=3, batch_size=2,
                                 progress=False, temperature=0.8, top_p=0.9)
    assert all(c.completion_tokens <= 3 for c in comps)
