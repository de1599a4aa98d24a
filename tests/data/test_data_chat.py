"""Chat format: loss on assistant turns only, ShareGPT input, FastChat templates, errors."""

from __future__ import annotations

import sys
import types

import pytest

from fedllm.data import DataError, make_encoder
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.recipe.schema import DataConfig

MESSAGES = [
    {"role": "system", "content": "You are good."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the cat sat"},
    {"role": "user", "content": "the dog?"},
    {"role": "assistant", "content": "the dog is good."},
]
CHAT = DataConfig(path="x", format="chat", template="tokenizer")


def supervised_runs(ex: dict) -> list[list[int]]:
    runs, current = [], []
    for label, tok in zip(ex["labels"], ex["input_ids"], strict=True):
        if label == IGNORE_INDEX:
            if current:
                runs.append(current)
            current = []
        else:
            assert label == tok
            current.append(tok)
    return runs + ([current] if current else [])


def test_assistant_turns_only(tokenizer):
    ex = make_encoder(tokenizer, CHAT, 512)({"messages": MESSAGES})
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert tokenizer.decode(ex["input_ids"]) == text
    replies = [tokenizer.decode(run) for run in supervised_runs(ex)]
    assert replies == ["the cat sat<|im_end|>\n", "the dog is good.<|im_end|>\n"]


def test_sharegpt_conversations_match_messages(tokenizer):
    conv = [{"from": "system", "value": "You are good."}, {"from": "human", "value": "hello world"},
            {"from": "gpt", "value": "the cat sat"}, {"from": "human", "value": "the dog?"},
            {"from": "gpt", "value": "the dog is good."}]
    encode = make_encoder(tokenizer, CHAT, 512)
    assert encode({"conversations": conv}) == encode({"messages": MESSAGES})


def test_truncation_and_drop(tokenizer):
    encode = make_encoder(tokenizer, CHAT, 512)
    full = encode({"messages": MESSAGES})
    first_reply = full["labels"].index(next(x for x in full["labels"] if x != IGNORE_INDEX))
    cut = make_encoder(tokenizer, CHAT, first_reply + 2)({"messages": MESSAGES})
    assert cut == {k: v[: first_reply + 2] for k, v in full.items()}
    assert make_encoder(tokenizer, CHAT, first_reply)({"messages": MESSAGES}) is None


def test_errors(tokenizer, tokenizer_no_bos):
    with pytest.raises(DataError, match="no chat template"):
        make_encoder(tokenizer_no_bos, CHAT, 64)
    encode = make_encoder(tokenizer, CHAT, 64)
    with pytest.raises(DataError, match="'messages' or 'conversations'"):
        encode({"text": "hi"})
    with pytest.raises(DataError, match="turn 0"):
        encode({"messages": [{"role": "robot", "content": "hi"}]})


def test_prefix_inconsistent_template_is_rejected(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = "{{ messages | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    with pytest.raises(DataError, match="prefix"):
        make_encoder(tok, CHAT, 64)({"messages": MESSAGES[1:3]})


def test_fastchat_missing(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "fastchat", None)
    monkeypatch.setitem(sys.modules, "fastchat.conversation", None)
    with pytest.raises(DataError, match="pip install fschat"):
        make_encoder(tokenizer, DataConfig(path="x", format="chat", template="vicuna_v1.1"), 64)


class _Conv:
    """The part of FastChat's Conversation the encoder uses (vicuna-like two-role format)."""

    roles = ("USER", "ASSISTANT")

    def __init__(self):
        self.system, self.messages = "A chat.", []

    def set_system_message(self, text):
        self.system = text

    def append_message(self, role, text):
        self.messages.append((role, text))

    def get_prompt(self):
        out = self.system + " "
        for role, text in self.messages:
            out += f"{role}: {text}</s>" if role == "ASSISTANT" and text is not None else f"{role}:" + (f" {text} " if text else "")
        return out


def test_fastchat_template(monkeypatch, tokenizer):
    module = types.ModuleType("fastchat.conversation")
    templates = {"toy": _Conv}
    module.get_conv_template = lambda name: templates[name]()
    monkeypatch.setitem(sys.modules, "fastchat", types.ModuleType("fastchat"))
    monkeypatch.setitem(sys.modules, "fastchat.conversation", module)
    cfg = DataConfig(path="x", format="chat", template="toy")
    ex = make_encoder(tokenizer, cfg, 512)({"messages": MESSAGES})
    assert ex["input_ids"][0] == tokenizer.bos_token_id and ex["labels"][0] == IGNORE_INDEX
    assert [tokenizer.decode(r) for r in supervised_runs(ex)] == [" the cat sat</s>", " the dog is good.</s>"]
    assert tokenizer.decode(ex["input_ids"][1:]).startswith("You are good. USER: hello world ASSISTANT:")
    with pytest.raises(DataError, match="unknown FastChat"):
        make_encoder(tokenizer, DataConfig(path="x", format="chat", template="nope"), 64)
