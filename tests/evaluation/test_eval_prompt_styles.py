"""Prompt styles: chat template, FastChat template (fschat faked), Alpaca, plain; schedule helpers."""

import sys
import types

import pytest

from fedllm.evaluation import eval_due, prompt_style_for_data
from fedllm.evaluation.prompt_styles import default_prompt_style, make_prompt_style, prompt_styles
from fedllm.recipe.schema import DataConfig, EvalConfig

TWO_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1"},
    {"role": "user", "content": "Q2"},
]


def test_registered_styles():
    assert prompt_styles.names() == ["alpaca", "chat", "plain"]


def test_chat_style_uses_the_tokenizer_template(tokenizer):
    text = make_prompt_style("chat", tokenizer).render(TWO_TURNS)
    assert text == "<|system|>Be brief.<|end|><|user|>Q1<|end|><|assistant|>A1<|end|><|user|>Q2<|end|><|assistant|>"


def test_chat_style_without_template_says_what_to_do(tokenizer):
    tokenizer.chat_template = None
    assert default_prompt_style(tokenizer) == "plain"
    with pytest.raises(ValueError, match="chat_template"):
        make_prompt_style("chat", tokenizer).render(TWO_TURNS)


def test_plain_style():
    text = make_prompt_style("plain", None).render(TWO_TURNS)
    assert text == "Be brief.\n\nQuestion: Q1\nAnswer: A1\n\nQuestion: Q2\nAnswer:"


def test_alpaca_style_repeats_the_template_per_turn(alpaca_prompt):
    style = make_prompt_style("alpaca", None)
    assert style.render([{"role": "user", "content": "Q", "instruction": "Do it", "input": "data"}]) == \
        alpaca_prompt("Do it", "data")
    assert style.render(TWO_TURNS) == alpaca_prompt("Q1") + "A1\n\n" + alpaca_prompt("Q2")
    with pytest.raises(ValueError, match="end with a user"):
        style.render(TWO_TURNS[:3])


class _FakeConv:
    def __init__(self):
        self.roles, self.messages, self.system = ("USER", "ASSISTANT"), [], ""

    def set_system_message(self, text):
        self.system = text

    def append_message(self, role, text):
        self.messages.append((role, text))

    def get_prompt(self):
        return self.system + "".join(f" {r}: {t}" if t is not None else f" {r}:" for r, t in self.messages)


def test_fastchat_template_by_name(monkeypatch, tokenizer):
    module = types.ModuleType("fastchat.conversation")
    module.get_conv_template = lambda name: _FakeConv()
    monkeypatch.setitem(sys.modules, "fastchat", types.ModuleType("fastchat"))
    monkeypatch.setitem(sys.modules, "fastchat.conversation", module)
    assert default_prompt_style(tokenizer, "vicuna_v1.1") == "chat"
    text = make_prompt_style("chat", tokenizer, "vicuna_v1.1").render(TWO_TURNS)
    assert text == "Be brief. USER: Q1 ASSISTANT: A1 USER: Q2 ASSISTANT:"


def test_fastchat_missing_is_a_clear_error(monkeypatch, tokenizer):
    monkeypatch.setitem(sys.modules, "fastchat", None)
    monkeypatch.setitem(sys.modules, "fastchat.conversation", None)
    with pytest.raises(ImportError, match=r"needs FastChat: .*pip install \"\.\[fastchat\]\" in a clone"):
        make_prompt_style("chat", tokenizer, "vicuna_v1.1").render(TWO_TURNS)


def test_prompt_style_for_training_data():
    assert prompt_style_for_data(DataConfig(format="instruction", template="alpaca")) == "alpaca"
    assert prompt_style_for_data(DataConfig(format="chat", template="tokenizer")) == "chat"
    assert prompt_style_for_data(DataConfig(format="classification")) is None


@pytest.mark.parametrize("every,before,rounds,due", [
    (0, False, 5, [5]),
    (2, False, 5, [2, 4, 5]),
    (2, True, 4, [0, 2, 4]),
])
def test_eval_due(every, before, rounds, due):
    cfg = EvalConfig(tasks=["gsm8k"], every=every, before_training=before)
    assert [r for r in range(rounds + 1) if eval_due(cfg, r, rounds)] == due
    assert not any(eval_due(EvalConfig(tasks=[], every=1), r, rounds) for r in range(rounds + 1))


@pytest.mark.parametrize("template, stop", [
    ("one_shot", ["###"]),                        # FastChat's conversation.py: stop_str="###"
    ("aquila-chat", ["###", "</s>", "[UNK]"]),     # a list of stop strings
    ("alpaca", []),                               # none: the model's end-of-sequence token ends it
])
def test_a_fastchat_template_cuts_answers_at_its_stop_str(tokenizer, template, stop):
    """FastChat's gen_model_answer cuts an answer at the template's stop_str; fedllm's generation cuts at the
    style's stop strings, so a FastChat-templated answer ends where FastChat's would."""
    pytest.importorskip("fastchat.conversation")
    from fedllm.evaluation.generation import _cut

    style = make_prompt_style("chat", tokenizer, template)
    assert style.stop == stop
    assert make_prompt_style("chat", tokenizer).stop == []  # the tokenizer's template: its end-of-turn token
    if stop:
        assert _cut(f"The answer is 4.\n{stop[-1]} Human: and 5?", style.stop)[0] == "The answer is 4.\n"
