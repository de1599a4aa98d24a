"""Prompt styles: how a conversation (a list of messages) becomes the text a model continues.

A conversation is a list of ``{"role", "content"}`` dicts ending with a user turn;
earlier user/assistant pairs are previous turns (a second MT-Bench turn, or
few-shot exemplars). User messages may also carry ``instruction`` and ``input``
keys, which the Alpaca style uses instead of ``content``.

Styles (registry names):

- ``chat``: the tokenizer's chat template, or the FastChat conversation template
  named by ``eval.chat_template`` (``fschat`` is imported only then).
- ``alpaca``: the Alpaca instruction template (from :mod:`fedllm.data.formats`, the
  same text training used); previous turns are earlier prompts plus their responses.
- ``plain``: ``Question: ...\\nAnswer: ...`` blocks, for base models and k-shot prompting.
"""

from __future__ import annotations

import abc
from typing import Optional

from fedllm.common.errors import InputError, install_hint
from fedllm.common.registry import Registry

Message = dict

prompt_styles: Registry = Registry("prompt style")


class PromptStyle(abc.ABC):
    """Renders conversations for one model.

    Attributes:
        stop: strings that end a generation in this style (a model continuing past
            its answer starts a new block with them).
    """

    stop: list[str] = []

    def __init__(self, tokenizer, chat_template: Optional[str] = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template

    @abc.abstractmethod
    def render(self, messages: list[Message]) -> str:
        """The prompt text for ``messages`` (ending where the assistant's reply begins)."""


def _pairs(messages: list[Message]) -> tuple[Optional[str], list[tuple[Message, Optional[Message]]]]:
    """``(system, [(user, assistant or None), ...])`` of a conversation."""
    system = None
    pairs: list[tuple[Message, Optional[Message]]] = []
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
        elif m["role"] == "user":
            pairs.append((m, None))
        elif m["role"] == "assistant":
            if not pairs or pairs[-1][1] is not None:
                raise ValueError("an assistant message must follow a user message")
            pairs[-1] = (pairs[-1][0], m)
    if not pairs or pairs[-1][1] is not None:
        raise ValueError("a conversation to render must end with a user message")
    return system, pairs


@prompt_styles.register("chat")
class ChatStyle(PromptStyle):
    """The tokenizer's chat template, or a named FastChat conversation template."""

    def render(self, messages: list[Message]) -> str:
        plain = [{"role": m["role"], "content": m["content"]} for m in messages]
        if self.chat_template:
            return _fastchat_prompt(self.chat_template, plain)
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(
                "the tokenizer has no chat template: set eval.chat_template (--chat-template) to a "
                "FastChat template name, or use the 'alpaca' or 'plain' prompt style"
            )
        return self.tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)

    @property
    def stop(self) -> list[str]:
        """A FastChat template's ``stop_str`` (one string or a list): FastChat's ``gen_model_answer``
        (fastchat/llm_judge/gen_model_answer.py, ``get_model_answers``) cuts each answer there. The tokenizer's
        template has none: its end-of-turn token ends the generation."""
        if not self.chat_template:
            return []
        stop = _fastchat_conversation(self.chat_template).stop_str
        return [stop] if isinstance(stop, str) and stop else [s for s in (stop or []) if s]


def _fastchat_conversation(template: str):
    try:
        from fastchat.conversation import get_conv_template
    except ImportError as e:
        raise ImportError(
            f"the FastChat conversation template {template!r} needs FastChat: {install_hint('fastchat')}; "
            "or leave eval.chat_template unset to use the tokenizer's template"
        ) from e
    return get_conv_template(template)


def _fastchat_prompt(template: str, messages: list[Message]) -> str:
    conv = _fastchat_conversation(template)
    system, pairs = _pairs(messages)
    if system is not None:
        conv.set_system_message(system)
    for user, assistant in pairs:
        conv.append_message(conv.roles[0], user["content"])
        conv.append_message(conv.roles[1], assistant["content"] if assistant else None)
    return conv.get_prompt()


@prompt_styles.register("alpaca")
class AlpacaStyle(PromptStyle):
    """The Alpaca template; a previous turn is its prompt followed by its response."""

    stop = ["### Instruction:"]

    def render(self, messages: list[Message]) -> str:
        from fedllm.data.formats import format_alpaca_prompt

        _, pairs = _pairs(messages)
        parts = []
        for user, assistant in pairs:
            instruction = user.get("instruction", user["content"])
            prompt = format_alpaca_prompt(instruction, user.get("input", ""))
            parts.append(prompt + (assistant["content"] + "\n\n" if assistant else ""))
        return "".join(parts)


@prompt_styles.register("plain")
class PlainStyle(PromptStyle):
    """``Question: ...\\nAnswer: ...`` blocks separated by blank lines."""

    stop = ["\nQuestion:"]

    def render(self, messages: list[Message]) -> str:
        system, pairs = _pairs(messages)
        head = f"{system}\n\n" if system else ""
        blocks = [
            f"Question: {user['content']}\nAnswer:" + (f" {assistant['content']}" if assistant else "")
            for user, assistant in pairs
        ]
        return head + "\n\n".join(blocks)


class ReferenceTemplateStyle(PromptStyle):
    """One fixed single-turn template with ``{instruction}`` (a reference script's prompt), no stop string.

    Used by the judged tasks under ``eval.judged_prompts: reference`` (not a ``--prompt-style``).
    """

    def __init__(self, tokenizer, template: str, name: str):
        super().__init__(tokenizer)
        self.template = template
        self.name = name
        self.stop = []

    def render(self, messages: list[Message]) -> str:
        _, pairs = _pairs(messages)
        if len(pairs) != 1:
            raise ValueError(f"the {self.name} template has one turn, got {len(pairs)}")
        user = pairs[0][0]
        return self.template.format(instruction=user.get("instruction") or user["content"])


def make_prompt_style(name: str, tokenizer, chat_template: Optional[str] = None) -> PromptStyle:
    """The registered prompt style ``name`` for ``tokenizer``."""
    return prompt_styles.get(name)(tokenizer, chat_template)


def default_prompt_style(tokenizer, chat_template: Optional[str] = None) -> str:
    """``chat`` when a chat template is available (the tokenizer's or a FastChat one), else ``plain``."""
    return "chat" if chat_template or getattr(tokenizer, "chat_template", None) else "plain"
