"""Hendrycks et al.'s MATH answer equivalence: a string normaliser, then string equality.

Written from the rules of ``is_equiv`` and ``strip_string`` in the MATH release's
``math_equivalence.py`` (the same functions MetaMath ships as ``util.py`` and calls from
``eval_math.py``; lm-evaluation-harness's ``hendrycks_math`` ``utils.py`` carries them too,
and a test checks this module against that copy). Nothing is imported from them.

:func:`is_equiv` normalises both answers and compares the results; when the normaliser
fails on either answer (a rule meets text it cannot handle, such as ``x/2`` or a
``\\sqrt`` at the very end), the raw strings are compared instead, as the reference's
``try/except`` does. The normaliser applies, in order:

1. drop line breaks and ``\\!``; ``\\\\`` becomes ``\\``; ``tfrac``/``dfrac`` become ``frac``;
   drop ``\\left``, ``\\right``, ``^{\\circ}``, ``^\\circ``, ``\\$``;
2. units: when ``\\text{ `` (with the space) occurs, keep what precedes it; it must occur
   exactly once (else the normaliser fails);
3. drop ``\\%``; `` .`` becomes `` 0.`` and ``{.`` becomes ``{0.``; an empty string stops here;
   a leading ``.`` gets a ``0``;
4. ``k = 5``: with exactly one ``=`` and at most two characters before it, keep the right side;
5. ``\\sqrt3`` becomes ``\\sqrt{3}`` (a ``\\sqrt`` with nothing after it fails);
6. drop spaces;
7. ``\\frac12`` becomes ``\\frac{1}{2}``, ``\\frac1{72}`` becomes ``\\frac{1}{72}``; a ``\\frac``
   followed by a single character leaves the string as it was; one followed by nothing fails;
8. exactly ``0.5`` becomes ``\\frac{1}{2}``;
9. ``a/b`` with exactly one slash: both sides must read as integers (else the normaliser
   fails) and, when the text is exactly ``int/int``, it becomes ``\\frac{a}{b}``.
"""

from __future__ import annotations

from typing import Callable, Optional


class _Unnormalisable(Exception):
    """The reference normaliser would raise on this text (the raw strings are then compared)."""


def _units_removed(s: str) -> str:
    marker = "\\text{ "
    if marker not in s:
        return s
    parts = s.split(marker)
    if len(parts) != 2:
        raise _Unnormalisable(s)
    return parts[0]


def _rewrite_arguments(s: str, command: str, rewrite: Callable[[str], Optional[str]]) -> str:
    """``s`` with the text after each ``command`` passed through ``rewrite`` (None: ``s`` is left as it was).

    Raises:
        _Unnormalisable: a ``command`` with nothing after it (the reference indexes past the end).
    """
    head, *pieces = s.split(command)
    out = head
    for piece in pieces:
        if not piece:
            raise _Unnormalisable(s)
        rewritten = rewrite(piece)
        if rewritten is None:
            return s
        out += command + rewritten
    return out


def _sqrt_argument(piece: str) -> str:
    """``3...`` -> ``{3}...``; a braced argument stays."""
    return piece if piece[0] == "{" else "{" + piece[0] + "}" + piece[1:]


def _frac_arguments(piece: str) -> Optional[str]:
    """``12...`` -> ``{1}{2}...``, ``1{72}`` -> ``{1}{72}``; braced stays; None for a single character."""
    if piece[0] == "{":
        return piece
    if len(piece) < 2:
        return None
    a, b, rest = piece[0], piece[1], piece[2:]
    return "{" + a + "}" + ("{" + b + "}" if b != "{" else b) + rest


def _slash_as_frac(s: str) -> str:
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError as e:
        raise _Unnormalisable(s) from e
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def normalise(s: str) -> str:
    """Hendrycks' ``strip_string`` rules (module docstring).

    Raises:
        _Unnormalisable: where the reference normaliser raises.
    """
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac").replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\$", "")
    s = _units_removed(s)
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _rewrite_arguments(s, "\\sqrt", _sqrt_argument).replace(" ", "")
    s = _rewrite_arguments(s, "\\frac", _frac_arguments)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def is_equiv(a: Optional[str], b: Optional[str]) -> bool:
    """Hendrycks' verdict: both None is equal; one None is not; else equal after :func:`normalise`."""
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalise(a) == normalise(b)
    except _Unnormalisable:
        return a == b
