"""Build the small byte-level BPE tokenizer shipped in fedllm/assets/tiny-tokenizer.

The tiny-* model presets use it, so tests and offline demos need no download.
Deterministic: the corpus below is fixed. Run: python data_prep/build_tiny_tokenizer.py
"""

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

OUT = Path(__file__).resolve().parents[1] / "fedllm" / "assets" / "tiny-tokenizer"
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\n### Input:\n### Response:\n#### The answer is",
    "Tom has 12 apples and buys 7 more. How many apples does Tom have now? 12 + 7 = 19",
    "A baker makes 6 trays of 8 cookies each. How many cookies are there? 6 * 8 = 48",
    "Sara had 45 stickers and gave away 17. How many are left? 45 - 17 = 28",
    "There are 36 pencils shared equally among 4 friends. How many does each friend get? 36 / 4 = 9",
    "the a an and or of to in is it that for on with as was he she they we you I this be at by not are from",
    "question answer user assistant system hello world good bad great terrible movie film review sentence",
    "entailment not_entailment positive negative acceptable unacceptable science sports politics computer",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 20 30 40 50 60 70 80 90 100 + - * / = , . ? ! : ; ( ) [ ] { } \\boxed",
]


def build() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A </s> $B",
                                                       special_tokens=[("<s>", 1), ("</s>", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    build().save_pretrained(str(OUT))
    print(f"wrote {OUT}")
