"""Chat records -> token ids with the loss on assistant turns only.

Records hold ``messages`` (``[{"role", "content"}]``) or ShareGPT
``conversations`` (``[{"from": "human"|"gpt"|"system", "value"}]``). The
conversation is rendered to text by a chat template: ``tokenizer`` uses the
tokenizer's own (``apply_chat_template``); any other ``DataConfig.template`` is a
FastChat conversation template (``pip install fschat``).

Boundaries are found incrementally: for every assistant turn ``i`` the template
renders ``messages[:i]`` with the generation prompt (where the reply starts) and
``messages[:i + 1]`` (where it ends, end-of-turn tokens included). Both must be
prefixes of the whole rendering; the text is cut at those points and each piece
tokenized on its own, so the supervised spans are exact. Examples longer than
``max_length`` are cut at the right end; one with no assistant token left is
dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from fedllm.data.errors import DataError
from fedllm.data.templates import record_field
from fedllm.data.tokens import IGNORE_INDEX, leading_bos, text_ids
from fedllm.recipe.schema import DataConfig

#: Speaker names (OpenAI and ShareGPT spellings) -> role.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bard": "assistant",
    "bing": "assistant",
}


@dataclass(frozen=True)
class ChatTemplate:
    """Renders a conversation to text.

    Attributes:
        name: Template name (``tokenizer`` or a FastChat name).
        render: ``render(messages, add_generation_prompt) -> text``.
        bos: Ids put in front of the rendering (FastChat prompts rely on the
            tokenizer adding BOS; tokenizer templates write it themselves).
    """

    name: str
    render: Callable[[list[dict], bool], str]
    bos: list[int]


def _tokenizer_template(tokenizer: Any, name: str) -> ChatTemplate:
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "data.template is 'tokenizer' but the tokenizer has no chat template; "
            "set data.template to a FastChat template name (e.g. vicuna_v1.1) or use the instruction format"
        )

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    return ChatTemplate(name, render, [])


def _fastchat_template(tokenizer: Any, name: str) -> ChatTemplate:
    try:
        from fastchat.conversation import get_conv_template
    except ImportError:
        raise DataError(
            f"data.template {name!r} is a FastChat conversation template, but FastChat is not installed: "
            "pip install fschat (or set data.template: tokenizer)"
        ) from None
    try:
        get_conv_template(name)
    except KeyError:
        raise DataError(f"unknown FastChat conversation template {name!r} (data.template)") from None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        conv = get_conv_template(name)
        for m in messages:
            if m["role"] == "system":
                conv.set_system_message(m["content"])
            else:
                conv.append_message(conv.roles[m["role"] == "assistant"], m["content"])
        if add_generation_prompt:
            conv.append_message(conv.roles[1], None)
        return conv.get_prompt()

    return ChatTemplate(name, render, leading_bos(tokenizer))


#: Template name -> factory; names not listed are FastChat templates.
CHAT_TEMPLATES: dict[str, Callable[[Any, str], ChatTemplate]] = {"tokenizer": _tokenizer_template}


def chat_template(tokenizer: Any, name: str) -> ChatTemplate:
    """The chat template ``name``: ``tokenizer`` or a FastChat conversation template.

    Raises:
        DataError: No chat template on the tokenizer, FastChat missing, or unknown name.
    """
    return CHAT_TEMPLATES.get(name, _fastchat_template)(tokenizer, name)


def record_messages(record: dict, data_cfg: DataConfig) -> list[dict]:
    """The conversation of a chat record as ``[{"role", "content"}]``.

    Args:
        record: A record with ``messages`` or ShareGPT ``conversations``
            (renamable through ``data.fields``).
        data_cfg: Column renames.

    Returns:
        Messages with roles ``system``, ``user`` or ``assistant``.

    Raises:
        DataError: No conversation column, or a turn without a known role or text.
    """
    turns = record_field(record, data_cfg, "messages", required=False)
    if turns is None:
        turns = record_field(record, data_cfg, "conversations", required=False)
    if not isinstance(turns, list):
        raise DataError(f"a chat record needs a 'messages' or 'conversations' list; its columns are {sorted(record)}")
    return [turn_message(turn, f"chat turn {i}") for i, turn in enumerate(turns)]


def turn_message(turn: Any, where: str, string_only: bool = False) -> dict:
    """One turn of a conversation (OpenAI ``role``/``content`` or ShareGPT ``from``/``value``) as a message
    ``{"role", "content"}``; a :class:`DataError` naming ``where`` for anything else (with ``string_only``, a
    content that is not a string too)."""
    speaker = turn.get("role", turn.get("from")) if isinstance(turn, dict) else None
    content = turn.get("content", turn.get("value")) if isinstance(turn, dict) else None
    role = ROLE_ALIASES.get(str(speaker).lower())
    if role is None or content is None or (string_only and not isinstance(content, str)):
        raise DataError(f"{where} needs a role/from in {sorted(ROLE_ALIASES)} and a {'string ' if string_only else ''}"
                        f"content/value; got {turn!r:.120}")
    return {"role": role, "content": str(content)}


def assistant_spans(messages: list[dict], render: Callable[[list[dict], bool], str]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant replies.

    Args:
        messages: The conversation.
        render: ``render(messages, add_generation_prompt) -> text``.

    Returns:
        ``(text, [(start, end), ...])``, one span per assistant turn, in order.

    Raises:
        DataError: The template does not render the conversation prefix-consistently.
    """
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start, end = render(messages[:i], True), render(messages[: i + 1], False)
        if not (end.startswith(start) and full.startswith(end)):
            raise DataError(
                f"the chat template does not render turn {i} as a prefix of the whole conversation, "
                "so assistant turns cannot be located; pick another data.template"
            )
        spans.append((len(start), len(end)))
    return full, spans


def chat_encoder(tokenizer: Any, data_cfg: DataConfig, max_length: int, label_names: Optional[list[str]] = None) -> Callable[[dict], Optional[dict]]:
    """Encoder of chat records with the loss on assistant turns only.

    Args:
        tokenizer: A Hugging Face tokenizer.
        data_cfg: ``template`` (``tokenizer`` or a FastChat name) and column renames.
        max_length: Longest example in tokens (cut at the right end).
        label_names: Unused.

    Returns:
        ``encode(record) -> {"input_ids", "labels"}`` (None when no assistant token fits).
    """
    template = chat_template(tokenizer, data_cfg.template)

    def encode(record: dict) -> Optional[dict]:
        text, spans = assistant_spans(record_messages(record, data_cfg), template.render)
        input_ids, labels = list(template.bos), [IGNORE_INDEX] * len(template.bos)
        pos = 0
        for start, end in [*spans, (len(text), len(text))]:
            context = text_ids(tokenizer, text[pos:start])
            reply = text_ids(tokenizer, text[start:end])
            input_ids += context + reply
            labels += [IGNORE_INDEX] * len(context) + reply
            pos = end
        input_ids, labels = input_ids[:max_length], labels[:max_length]
        if all(label == IGNORE_INDEX for label in labels):
            return None
        return {"input_ids": input_ids, "labels": labels}

    return encode
