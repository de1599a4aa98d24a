"""Instruction and classification formats: the Alpaca text, loss masks, truncation, labels."""

from __future__ import annotations

import pytest

from fedllm.data import DataError, encode_records, format_prompt, make_encoder, resolve_label_names
from fedllm.data.formats import fit_prompt_response
from fedllm.data.tokens import IGNORE_INDEX, text_ids
from fedllm.recipe.schema import DataConfig

ALPACA_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
ALPACA_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def test_alpaca_template_text():
    cfg = DataConfig(path="x")
    rec = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    assert format_prompt(rec, cfg) == ALPACA_INPUT.format(instruction="Add the numbers.", input="2 and 3")
    for empty in ("", None):
        rec = {"instruction": "Say hi.", "input": empty, "output": "hi"}
        assert format_prompt(rec, cfg) == ALPACA_NO_INPUT.format(instruction="Say hi.")
    assert format_prompt({"instruction": "Say hi.", "output": "hi"}, cfg) == ALPACA_NO_INPUT.format(instruction="Say hi.")


def test_stanford_alpaca_variant_has_no_newline_after_response():
    cfg = DataConfig(path="x", template="stanford_alpaca")
    assert format_prompt({"instruction": "Go."}, cfg).endswith("### Instruction:\nGo.\n\n### Response:")


def test_field_renames_gsm8k_style():
    cfg = DataConfig(path="x", fields={"instruction": "question", "output": "answer"})
    rec = {"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}
    assert format_prompt(rec, cfg) == ALPACA_NO_INPUT.format(instruction="What is 2+2?")
    with pytest.raises(DataError, match="'question'"):
        format_prompt({"instruction": "x"}, cfg)


def test_unknown_template():
    with pytest.raises(DataError, match="stanford_alpaca"):
        format_prompt({"instruction": "x"}, DataConfig(path="x", template="nope"))


@pytest.mark.parametrize("fixture", ["tokenizer", "tokenizer_no_bos"])
def test_instruction_loss_mask(fixture, request):
    tok = request.getfixturevalue(fixture)
    cfg = DataConfig(path="x")
    rec = {"instruction": "How many apples does Tom have now?", "input": "Tom has 12 apples.", "output": "Tom has 19 apples."}
    ex = make_encoder(tok, cfg, 512)(rec)
    bos = [tok.bos_token_id] if fixture == "tokenizer" else []
    prompt = text_ids(tok, format_prompt(rec, cfg))
    response = text_ids(tok, rec["output"]) + [tok.eos_token_id]
    assert ex["input_ids"] == bos + prompt + response
    n_masked = len(bos) + len(prompt)
    assert ex["labels"][:n_masked] == [IGNORE_INDEX] * n_masked
    assert ex["labels"][n_masked:] == ex["input_ids"][n_masked:] == response
    assert tok.decode(ex["labels"][n_masked:]) == "Tom has 19 apples.</s>"
    assert tok.decode(ex["input_ids"], skip_special_tokens=True) == format_prompt(rec, cfg) + rec["output"]


@pytest.mark.parametrize("template", ["openfedllm", "flowertune"])
def test_instruction_after_a_trailing_space_tokenizes_the_whole_text(template):
    """A prompt ending in "### Response: " (OpenFedLLM's, FlowerTune's): the ids are the tokenizer's of the whole
    text, as their trl trainers make them (the space joins the answer's first word), and the loss is on the
    tokens that hold answer characters."""
    from transformers import AutoTokenizer

    from fedllm.models.loading import TINY_TOKENIZER_DIR

    tokenizer = AutoTokenizer.from_pretrained(str(TINY_TOKENIZER_DIR))  # byte-level BPE with "Ġon" (SmolLM2's kind)
    cfg = DataConfig(path="x", template=template)
    rec = {"instruction": "Where did the cat sit?", "output": "on the mat."}
    ex = make_encoder(tokenizer, cfg, 512)(rec)
    prompt = format_prompt(rec, cfg)
    assert prompt.endswith("### Response: ")
    whole = text_ids(tokenizer, prompt + rec["output"])
    bos = [tokenizer.bos_token_id] if tokenizer("a")["input_ids"][0] == tokenizer.bos_token_id else []
    assert ex["input_ids"] == bos + whole + [tokenizer.eos_token_id]
    assert whole != text_ids(tokenizer, prompt) + text_ids(tokenizer, rec["output"])  # separately: a lone space token
    supervised = [t for t, label in zip(ex["input_ids"], ex["labels"], strict=True) if label != IGNORE_INDEX]
    assert tokenizer.decode(supervised) == " on the mat." + tokenizer.eos_token
    assert tokenizer.decode(ex["input_ids"][len(bos): len(ex["input_ids"]) - len(supervised)]) == prompt[:-1]


def test_instruction_truncation_keeps_response(tokenizer):
    cfg = DataConfig(path="x")
    rec = {"instruction": "the cat sat on the mat. " * 30, "output": "the dog is good."}
    full = make_encoder(tokenizer, cfg, 10_000)(rec)
    response = text_ids(tokenizer, rec["output"]) + [tokenizer.eos_token_id]
    ex = make_encoder(tokenizer, cfg, 64)(rec)
    assert len(ex["input_ids"]) == 64 and ex["input_ids"][0] == tokenizer.bos_token_id
    assert ex["input_ids"][-len(response):] == response == ex["labels"][-len(response):]
    assert ex["labels"][: 64 - len(response)] == [IGNORE_INDEX] * (64 - len(response))
    # the prompt lost its left end: what is kept is the end of the full prompt ("### Response:\n")
    assert ex["input_ids"][1 : 64 - len(response)] == full["input_ids"][len(full["input_ids"]) - 63 : -len(response)]


def test_fit_prompt_response():
    p, r = list(range(10)), list(range(100, 110))
    assert fit_prompt_response(p, r, 30) == (p, r)
    assert fit_prompt_response(p, r[:2], 8) == (p[4:], r[:2])  # prompt cut from the left
    assert fit_prompt_response(p, r, 8) == (p[6:], r[:4])  # both long: prompt keeps half the window
    assert fit_prompt_response(p[:2], r, 8) == (p[:2], r[:6])
    assert fit_prompt_response(p, r, 1) == ([], r[:1])


def test_classification_string_labels(tokenizer):
    cfg = DataConfig(path="x", format="classification", fields={"text": "sentence"})
    recs = [{"sentence": "the movie was bad", "label": "neg"}, {"sentence": "the movie was good", "label": "pos"},
            {"sentence": "the cat", "label": "neutral"}]
    names = resolve_label_names(recs, cfg)
    assert names == ["neg", "neutral", "pos"]
    exs = encode_records(recs, tokenizer, cfg, 32, names)
    assert [e["label"] for e in exs] == [0, 2, 1]
    assert exs[0]["input_ids"] == tokenizer("the movie was bad")["input_ids"]
    assert set(exs[0]) == {"input_ids", "label"}


def test_classification_given_names_and_int_labels(tokenizer):
    cfg = DataConfig(path="x", format="classification", labels=["negative", "positive"])
    recs = [{"text": "bad", "label": "positive"}, {"text": "good", "label": 0}, {"text": "ok", "label": True}]
    assert [e["label"] for e in encode_records(recs, tokenizer, cfg, 16, resolve_label_names(recs, cfg))] == [1, 0, 1]
    ints = DataConfig(path="x", format="classification")
    recs = [{"text": "a", "label": 3}, {"text": "b", "label": 1}]
    names = resolve_label_names(recs, ints)
    assert names == ["0", "1", "2", "3"]
    assert [e["label"] for e in encode_records(recs, tokenizer, ints, 16, names)] == [3, 1]


def test_classification_text_pair_and_truncation(tokenizer):
    cfg = DataConfig(path="x", format="classification", fields={"text": "premise", "text_pair": "hypothesis"})
    rec = {"premise": "the cat sat on the mat", "hypothesis": "the dog is good", "label": 0}
    ex = make_encoder(tokenizer, cfg, 512, ["0", "1"])(rec)
    assert ex["input_ids"] == tokenizer(rec["premise"], rec["hypothesis"])["input_ids"]
    assert len(make_encoder(tokenizer, cfg, 8, ["0", "1"])(rec)["input_ids"]) == 8


def test_classification_label_errors(tokenizer):
    cfg = DataConfig(path="x", format="classification", labels=["a", "b"])
    with pytest.raises(DataError, match="'c' is not one of"):
        encode_records([{"text": "x", "label": "c"}], tokenizer, cfg, 8, ["a", "b"])
    with pytest.raises(DataError, match="out of range"):
        encode_records([{"text": "x", "label": 5}], tokenizer, cfg, 8, ["a", "b"])
    plain = DataConfig(path="x", format="classification")
    with pytest.raises(DataError, match=">= 0"):
        resolve_label_names([{"text": "x", "label": -1}], plain)
    with pytest.raises(DataError, match="mix types"):
        resolve_label_names([{"text": "x", "label": 1}, {"text": "y", "label": "a"}], plain)


def test_unknown_format(tokenizer):
    with pytest.raises(DataError, match="unknown data.format"):
        make_encoder(tokenizer, DataConfig(path="x", format="poetry"), 8)


def test_format_alpaca_prompt():
    from fedllm.data.formats import format_alpaca_prompt

    assert format_alpaca_prompt("Go.") == ALPACA_NO_INPUT.format(instruction="Go.")
    assert format_alpaca_prompt("Go.", "far") == ALPACA_INPUT.format(instruction="Go.", input="far")
