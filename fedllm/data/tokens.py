"""Token-level helpers shared by the formats: the ignore label, plain and BOS ids."""

from __future__ import annotations

from typing import Any

#: Label of positions that carry no loss (the ``ignore_index`` of cross-entropy).
IGNORE_INDEX = -100


def text_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens.

    Args:
        tokenizer: A Hugging Face tokenizer.
        text: The text.

    Returns:
        The ids (empty for empty text).
    """
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def leading_bos(tokenizer: Any) -> list[int]:
    """``[bos_token_id]`` when the tokenizer puts BOS in front of encoded text, else ``[]``.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        The BOS prefix that ``tokenizer(text)`` would add.
    """
    bos = tokenizer.bos_token_id
    if bos is None:
        return []
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return [bos] if len(ids) > 0 and ids[0] == bos else []
