"""Fixtures of the data tests: a tiny BPE tokenizer with BOS and a chat template."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n",
    "Tom has 12 apples and buys 7 more. How many apples does Tom have now? #### 19",
    "the cat sat on the mat. the dog is good. the movie was bad. hello world user assistant system",
]


def build_tokenizer(bos: bool = True, chat_template: str | None = CHAT_TEMPLATE):
    """A byte-level BPE tokenizer (300 tokens) wrapped as a transformers fast tokenizer.

    Args:
        bos: Whether encoding adds ``<s>`` in front (as LLaMA tokenizers do).
        chat_template: Jinja chat template, or None for none.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A </s> $B", special_tokens=[("<s>", 1), ("</s>", 2)]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="session")
def tokenizer():
    """Tiny tokenizer that adds BOS and has a ChatML-like chat template."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tokenizer_no_bos():
    """Tiny tokenizer that adds no special tokens and has no chat template."""
    return build_tokenizer(bos=False, chat_template=None)
