"""GSM8K-style numeric answers: extraction from free text and numeric comparison.

The answer of a text is the number after ``####`` (the GSM8K reference format),
else the number after "The answer is" (chain-of-thought exemplars, MetaMathQA),
else the last number in the text. Numbers may carry thousands separators, a
sign, a currency sign, decimals or a trailing period; they compare numerically.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_NUMBER = r"(?:(?<![\w)])-)?\$?\s?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?(?:/\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*(" + _NUMBER + ")")
_ANSWER_IS_RE = re.compile(r"the (?:final )?answer is[:\s]*\**\s*(" + _NUMBER + ")", re.IGNORECASE)


def _clean(number: str) -> str:
    return number.replace(",", "").replace("$", "").replace(" ", "")


def extract_number(text: str) -> Optional[str]:
    """The answer number of ``text`` (commas and currency removed), or None.

    Args:
        text: a model output or a GSM8K reference solution.

    Returns:
        The number as a string, e.g. ``"1234.5"`` or ``"-3"``; None when ``text`` has no number.
    """
    for pattern in (_HASH_RE, _ANSWER_IS_RE):
        match = pattern.search(text)
        if match:
            return _clean(match.group(1))
    numbers = _NUMBER_RE.findall(text)
    return _clean(numbers[-1]) if numbers else None


def to_number(text: Optional[str]) -> Optional[Fraction]:
    """Exact value of a number string (``"1,000"``, ``"2.50"``, ``"3/4"``), or None."""
    if text is None:
        return None
    try:
        return Fraction(_clean(text).rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def numbers_equal(predicted: Optional[str], gold: Optional[str]) -> bool:
    """Whether two number strings have the same value (``"18.00"`` == ``"18"``)."""
    a, b = to_number(predicted), to_number(gold)
    return a is not None and b is not None and a == b
