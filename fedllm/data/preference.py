"""Preference records (``data.format: preference``) -> a prompt and two answers, tokenized as trl does.

A record is read into a prompt and a chosen and a rejected answer (:func:`preference_parts`), from any of
the forms preference data sets come in (columns renamed by ``data.fields``: ``prompt``, ``chosen``,
``rejected``):

* ``{"prompt": str, "chosen": str, "rejected": str}`` (trl's standard form, UltraFeedback-binarized's
  strings);
* conversational: ``chosen`` / ``rejected`` as message lists (``[{"role", "content"}]`` or ShareGPT
  ``{"from", "value"}``), with ``prompt`` a message list or a string, or left out: the turns ``chosen`` and
  ``rejected`` share are then the prompt (trl's ``extract_prompt``; also when ``prompt`` is a string and the
  answers are whole conversations, as in UltraFeedback-binarized);
* HH-RLHF's whole dialogues: ``chosen`` and ``rejected`` strings ``"\\n\\nHuman: ... \\n\\nAssistant: ..."``
  without a prompt. With ``data.template: plain`` they are split on their common prefix exactly as trl's
  ``extract_prompt`` does; with any other template each dialogue is split at its last ``"\\n\\nAssistant:"``
  (the dialogue before it must be the same in both) and parsed into user/assistant turns, the conversational
  form trl's ``hh-rlhf-helpful-base`` holds.

The prompt is rendered with ``data.template``: ``tokenizer`` (the tokenizer's chat template, default) or a
FastChat conversation template render messages; ``plain`` (the text as given) or an instruction template
(``alpaca``, ...) render a single-turn prompt as text, and the answers get the EOS token appended, as trl does
for non-conversational data. Tokens follow trl's ``DPOTrainer``: the prompt alone and the prompt followed by
each answer are tokenized, the answers start where these diverge from the prompt's tokens, each sequence is
cut at ``max_length`` at its right end, and a record whose prompt alone fills ``max_length`` is dropped
(``too_long``). The loss is taken on the answer tokens only.

An example holds the chosen sequence as ``input_ids`` / ``labels`` (``-100`` on the prompt) and the rejected one
as ``rejected_input_ids`` / ``rejected_labels``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedllm.data.chat import chat_template, turn_message
from fedllm.data.errors import DataError
from fedllm.data.templates import INSTRUCTION_TEMPLATES, field_name
from fedllm.data.tokens import IGNORE_INDEX, leading_bos, text_ids
from fedllm.recipe.schema import DataConfig

Messages = list[dict]
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"
#: Text templates besides the instruction templates: the prompt exactly as given.
PLAIN = "plain"


@dataclass(frozen=True)
class PreferenceParts:
    """A preference record read: the prompt and the two answers, all text or all messages."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages

    @property
    def conversational(self) -> bool:
        """Whether the parts are message lists."""
        return isinstance(self.chosen, list)


def _messages(turns: Any, what: str) -> Messages:
    if not isinstance(turns, list):
        raise DataError(f"{what} must be a string or a list of turns; got {type(turns).__name__}")
    return [turn_message(turn, f"{what}: turn {i}", string_only=True) for i, turn in enumerate(turns)]


def extract_prompt_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """trl's ``extract_prompt`` on strings: the common prefix is the prompt (a space before the point where the
    two differ is left to the answers)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def extract_prompt_turns(chosen: Messages, rejected: Messages) -> tuple[Messages, Messages, Messages]:
    """trl's ``extract_prompt`` on conversations: the leading turns both share are the prompt."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def dialogue_turns(text: str) -> Messages:
    """HH-RLHF's ``"\\n\\nHuman: ...\\n\\nAssistant: ..."`` text as user/assistant turns (contents stripped)."""
    turns, pos, role = [], 0, None
    while pos < len(text):
        h, a = text.find(HUMAN, pos), text.find(ASSISTANT, pos)
        nxt = min((x for x in (h, a) if x >= 0), default=len(text))
        if role is not None:
            turns.append({"role": role, "content": text[pos:nxt].strip()})
        elif text[pos:nxt].strip():
            raise DataError(f"a dialogue must start with {HUMAN.strip()!r}; it starts with {text[:40]!r}")
        if nxt == len(text):
            break
        role = "user" if nxt == h else "assistant"
        pos = nxt + len(HUMAN if nxt == h else ASSISTANT)
    return turns


def split_dialogue(chosen: str, rejected: str) -> tuple[Messages, Messages, Messages]:
    """HH-RLHF dialogues -> (prompt turns, chosen answer, rejected answer): each split at its last Assistant turn."""
    parts = []
    for name, text in (("chosen", chosen), ("rejected", rejected)):
        cut = text.rfind(ASSISTANT)
        if cut < 0 or HUMAN not in text[: cut + 1]:
            raise DataError(
                f"{name} has no prompt column and is no '\\n\\nHuman: ... \\n\\nAssistant: ...' dialogue "
                "to split (give a prompt column, map it with data.fields, or use data.template: plain)"
            )
        parts.append((text[:cut], text[cut + len(ASSISTANT) :].strip()))
    if parts[0][0] != parts[1][0]:
        raise DataError(
            "chosen and rejected differ before their last Assistant turn, so no shared prompt can be split off"
        )
    answer = [{"role": "assistant", "content": parts[0][1]}], [{"role": "assistant", "content": parts[1][1]}]
    return dialogue_turns(parts[0][0]), *answer


def preference_parts(record: dict, data_cfg: DataConfig) -> PreferenceParts:
    """The prompt and the two answers of a preference record (see the module docstring for the forms).

    Raises:
        DataError: A missing answer column, a value of the wrong type, or a dialogue that cannot be split.
    """
    values = {}
    for key in ("chosen", "rejected"):
        column = field_name(data_cfg, key)
        if column not in record:
            renamed = f" (data.fields maps {key!r} to it)" if column != key else ""
            raise DataError(f"field {column!r}{renamed} is missing; the record has {sorted(record)}")
        values[key] = record[column]
    prompt = record.get(field_name(data_cfg, "prompt"))
    chosen, rejected = values["chosen"], values["rejected"]
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise DataError("chosen and rejected must both be strings or both be lists of turns")
    if isinstance(chosen, str):
        if isinstance(prompt, str):
            return PreferenceParts(prompt, chosen, rejected)
        if prompt is not None:
            raise DataError(f"prompt must be a string when the answers are strings; got {type(prompt).__name__}")
        if data_cfg.template == PLAIN:
            return PreferenceParts(*extract_prompt_text(chosen, rejected))
        return PreferenceParts(*split_dialogue(chosen, rejected))
    chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
    if isinstance(prompt, list):
        return PreferenceParts(_messages(prompt, "prompt"), chosen, rejected)
    if prompt is not None and not isinstance(prompt, str):
        raise DataError(f"prompt must be a string or a list of turns; got {type(prompt).__name__}")
    if isinstance(prompt, str) and chosen[0]["role"] == "assistant":  # answers alone, prompt as text
        return PreferenceParts([{"role": "user", "content": prompt}], chosen, rejected)
    return PreferenceParts(*extract_prompt_turns(chosen, rejected))  # whole conversations (trl: prompt ignored)


def answer_texts(parts: PreferenceParts) -> tuple[str, str]:
    """The two answers as text (every turn's content joined), to tell empty or identical answers."""

    def text(x: str | Messages) -> str:
        return x if isinstance(x, str) else "\n".join(m["content"] for m in x)

    return text(parts.chosen), text(parts.rejected)


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Rendered:
    """Texts to tokenize: the prompt alone and the prompt followed by each answer; ``bos`` goes in front."""

    prompt: str
    chosen: str
    rejected: str
    bos: list[int]


def _as_messages(x: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": x}] if isinstance(x, str) else x


def _single_text(x: str | Messages, role: str, template: str) -> str:
    if isinstance(x, str):
        return x
    if len(x) != 1 or x[0]["role"] != role:
        raise DataError(
            f"data.template {template!r} renders a single {role} turn as text; this record has "
            f"{[m['role'] for m in x]} (use data.template: tokenizer or a FastChat template for dialogues)"
        )
    return x[0]["content"]


def chat_renderer(tokenizer: Any, name: str) -> Callable[[PreferenceParts], Rendered]:
    """Render with a chat template (``tokenizer`` or a FastChat name): prompt with the generation prompt."""
    template = chat_template(tokenizer, name)

    def render(parts: PreferenceParts) -> Rendered:
        prompt = _as_messages(parts.prompt, "user")
        return Rendered(
            template.render(prompt, True),
            template.render(prompt + _as_messages(parts.chosen, "assistant"), False),
            template.render(prompt + _as_messages(parts.rejected, "assistant"), False),
            template.bos,
        )

    return render


def text_renderer(tokenizer: Any, name: str) -> Callable[[PreferenceParts], Rendered]:
    """Render as text (``plain`` or an instruction template); each answer ends with the EOS token (as trl)."""
    fmt = (lambda p: p) if name == PLAIN else (lambda p: INSTRUCTION_TEMPLATES[name].prompt(p, ""))
    eos, bos = tokenizer.eos_token or "", leading_bos(tokenizer)

    def with_eos(text: str) -> str:
        return text if text.endswith(eos) else text + eos

    def render(parts: PreferenceParts) -> Rendered:
        prompt = fmt(_single_text(parts.prompt, "user", name))
        return Rendered(
            prompt,
            prompt + with_eos(_single_text(parts.chosen, "assistant", name)),
            prompt + with_eos(_single_text(parts.rejected, "assistant", name)),
            bos,
        )

    return render


def renderer(tokenizer: Any, name: str) -> Callable[[PreferenceParts], Rendered]:
    """The renderer of ``data.template`` ``name``: text for ``plain`` and instruction templates, else chat."""
    if name == PLAIN or name in INSTRUCTION_TEMPLATES:
        return text_renderer(tokenizer, name)
    return chat_renderer(tokenizer, name)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def preference_tokens(tokenizer: Any, rendered: Rendered) -> tuple[list[int], list[int], list[int]]:
    """``(prompt, chosen, rejected)`` ids as trl's DPOTrainer tokenizes them: the answers start where the prompt's
    tokens and the prompt+answer tokens diverge."""
    prompt, chosen, rejected = (
        rendered.bos + text_ids(tokenizer, t) for t in (rendered.prompt, rendered.chosen, rendered.rejected)
    )
    cut = min(common_prefix_length(prompt, chosen), common_prefix_length(prompt, rejected))
    return prompt[:cut], chosen[cut:], rejected[cut:]


def preference_encoder(
    tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: list[str] | None = None
) -> Callable[[dict], dict | None]:
    """Encoder of preference records: chosen and rejected sequences with the loss on the answer tokens.

    Returns:
        ``encode(record) -> {"input_ids", "labels", "rejected_input_ids", "rejected_labels"}``; None when the
        prompt alone fills ``max_length`` (trl drops such records too).
    """
    render = renderer(tokenizer, data_cfg.template)

    def encode(record: dict) -> dict | None:
        prompt, chosen, rejected = preference_tokens(tokenizer, render(preference_parts(record, data_cfg)))
        if len(prompt) >= max_length or not chosen or not rejected:
            return None
        masked = [IGNORE_INDEX] * len(prompt)
        return {
            "input_ids": (prompt + chosen)[:max_length],
            "labels": (masked + chosen)[:max_length],
            "rejected_input_ids": (prompt + rejected)[:max_length],
            "rejected_labels": (masked + rejected)[:max_length],
        }

    return encode
