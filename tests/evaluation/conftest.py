"""Fixtures of the evaluation tests: a byte-level BPE tokenizer trained here, tiny LLaMA models,
a scripted model whose generations are fixed by the test, and the Alpaca prompt function."""

from __future__ import annotations

import copy

import pytest
import torch
from evalkit import CHAT_TEMPLATE, ScriptedLM, tiny_llama_config

_CORPUS = [
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have? Answer: The answer is 7.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction: ### Response: Rating: [[5]] The assistant's answer is helpful and accurate.",
    "Compose an engaging travel blog post about a recent trip to Hawaii. The area of the triangle is 3.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1,200 2,400 #### $12.50 -3 + - * / = << >>",
]


def _train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<pad>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"],
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def tokenizer_state():
    return _train_tokenizer()


@pytest.fixture
def tokenizer(tokenizer_state):
    """A fresh copy per test (tests change padding side / templates)."""
    return copy.deepcopy(tokenizer_state)


@pytest.fixture
def tiny_lm(tokenizer):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


@pytest.fixture
def scripted_lm(tiny_lm, tokenizer):
    def make(script: dict[str, str], default: str = "I do not know.") -> ScriptedLM:
        return ScriptedLM(tiny_lm, tokenizer, script, default)

    return make


@pytest.fixture
def alpaca_prompt(monkeypatch):
    """``fedllm.data.formats.format_alpaca_prompt``, provided from the project's template if not there yet."""
    import fedllm.data.formats as formats

    if not hasattr(formats, "format_alpaca_prompt"):
        from fedllm.data.templates import INSTRUCTION_TEMPLATES

        monkeypatch.setattr(formats, "format_alpaca_prompt", INSTRUCTION_TEMPLATES["alpaca"].prompt, raising=False)
    return formats.format_alpaca_prompt
