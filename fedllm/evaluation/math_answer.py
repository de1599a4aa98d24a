"""MATH answers: ``\\boxed{}`` extraction and the usual LaTeX normalisation.

The normalisation follows Hendrycks et al.'s ``is_equiv`` (the MATH data set's
reference scorer): drop line breaks, ``\\!``, ``\\left``/``\\right``, degree
signs, dollar and percent signs, units written with ``\\text{ ...}`` or
``\\mbox``, spaces and a short ``x =`` prefix; ``tfrac``/``dfrac`` become
``frac``; ``\\frac12`` becomes ``\\frac{1}{2}`` and ``\\sqrt2`` ``\\sqrt{2}``;
``a/b`` of integers becomes ``\\frac{a}{b}`` and ``0.5`` ``\\frac{1}{2}``.
Two answers whose normal forms are plain numbers compare by value.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

_ANSWER_IS_RE = re.compile(r"the (?:final )?answer is[:\s]*(.+)", re.IGNORECASE)


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, ``\\boxed x``) in ``text``, or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    head = "\\boxed" if rest.startswith("\\boxed") else "\\fbox"
    rest = rest[len(head):]
    if rest.startswith(" "):
        return rest[1:].split("$")[0].strip()
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def extract_math_answer(text: str) -> Optional[str]:
    """The final answer of a MATH solution or model output.

    The last ``\\boxed{}`` wins; else the text after "The answer is" (MetaMathQA
    style) up to the end of its line; else None.
    """
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    match = _ANSWER_IS_RE.search(text)
    if match:
        answer = match.group(1).strip().splitlines()[0].strip()
        return answer.rstrip(".").strip().strip("$").strip() or None
    return None


def _fix_fracs(s: str) -> str:
    parts = s.split("\\frac")
    out = parts[0]
    for part in parts[1:]:
        out += "\\frac"
        if part.startswith("{") or len(part) < 2:
            out += part
            continue
        a, b, post = part[0], part[1], part[2:]
        out += "{" + a + "}" + (b + post if b == "{" else "{" + b + "}" + post)
    return out


def _fix_a_slash_b(s: str) -> str:
    match = re.fullmatch(r"(-?\d+)/(\d+)", s)
    return f"\\frac{{{match.group(1)}}}{{{match.group(2)}}}" if match else s


def _fix_sqrt(s: str) -> str:
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


def _remove_right_units(s: str) -> str:
    for marker in ("\\text{ ", "\\mbox{ ", "\\mbox{"):
        if marker in s:
            return s.split(marker)[0]
    return s


def normalize_math_answer(answer: Optional[str]) -> Optional[str]:
    """Normal form of a MATH answer string (see the module docstring); None stays None."""
    if answer is None:
        return None
    s = answer.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "").replace("$", "")
    s = _remove_right_units(s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    s = s.strip().rstrip(".")
    if not s:
        return s
    if s.startswith("."):
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0].strip()) <= 2:
        s = sides[1]
    s = _fix_sqrt(s)
    s = s.replace(" ", "")
    s = _fix_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _fix_a_slash_b(s)


def _value(s: str) -> Optional[Fraction]:
    match = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(\d+)\}", s)
    try:
        if match:
            value = Fraction(int(match.group(2)), int(match.group(3)))
            return -value if match.group(1) else value
        if re.fullmatch(r"-?\d+(?:\.\d+)?", s.replace(",", "")):
            return Fraction(s.replace(",", ""))
    except ZeroDivisionError:
        return None
    return None


def math_equal(predicted: Optional[str], gold: Optional[str]) -> bool:
    """Whether two MATH answers are equivalent after normalisation."""
    a, b = normalize_math_answer(predicted), normalize_math_answer(gold)
    if a is None or b is None:
        return False
    if a == b:
        return True
    va, vb = _value(a), _value(b)
    return va is not None and va == vb
