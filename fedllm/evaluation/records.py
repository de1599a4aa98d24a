"""Read the question and the reference answer out of raw records of any common layout.

Handles GSM8K (``question``/``answer``), MATH (``problem``/``solution``), Alpaca
(``instruction``/``input``/``output``), MetaMathQA (``query``/``response``) and
chat records (``messages`` or ``conversations`` lists of turns).
"""

from __future__ import annotations

from typing import Optional

from fedllm.evaluation.sources import DataSourceError

QUESTION_KEYS = ("question", "problem", "instruction", "query", "prompt", "text")
ANSWER_KEYS = ("answer", "solution", "output", "response", "completion")
_ROLE_KEYS = ("role", "from")
_CONTENT_KEYS = ("content", "value")
_USER_ROLES = ("user", "human")
_ASSISTANT_ROLES = ("assistant", "gpt", "model")


def _first(record: dict, keys: tuple[str, ...]) -> Optional[str]:
    for k in keys:
        v = record.get(k)
        if isinstance(v, str) and v.strip():
            return v
    return None


def _turn(record: dict, roles: tuple[str, ...]) -> Optional[str]:
    turns = record.get("messages") or record.get("conversations")
    if not isinstance(turns, list):
        return None
    for t in turns:
        if not isinstance(t, dict):
            continue
        role = next((t[k] for k in _ROLE_KEYS if k in t), None)
        if role in roles:
            return next((t[k] for k in _CONTENT_KEYS if k in t), None)
    return None


def question_of(record: dict) -> str:
    """The question / instruction of a record (Alpaca ``input`` appended on a new line).

    Raises:
        DataSourceError: the record has no recognisable question field.
    """
    chat = _turn(record, _USER_ROLES)
    if chat is not None:
        return chat
    q = _first(record, QUESTION_KEYS)
    if q is None:
        raise DataSourceError(f"no question field ({', '.join(QUESTION_KEYS)} or messages) "
                              f"in a record with keys {sorted(record)}")
    extra = record.get("input")
    return f"{q}\n\n{extra}" if isinstance(extra, str) and extra.strip() else q


def answer_of(record: dict) -> str:
    """The reference answer of a record.

    Raises:
        DataSourceError: the record has no recognisable answer field.
    """
    chat = _turn(record, _ASSISTANT_ROLES)
    if chat is not None:
        return chat
    a = _first(record, ANSWER_KEYS)
    if a is None:
        raise DataSourceError(f"no answer field ({', '.join(ANSWER_KEYS)} or messages) "
                              f"in a record with keys {sorted(record)}")
    return a


def instruction_and_input(record: dict) -> tuple[str, str]:
    """``(instruction, input)`` for the Alpaca template (input empty unless the record has one)."""
    if "instruction" in record and isinstance(record.get("input"), str):
        return record["instruction"], record["input"]
    return question_of(record), ""
