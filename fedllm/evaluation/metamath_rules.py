"""MetaMath's GSM8K and MATH evaluation (Yu et al., 2024), the protocol FRLoRA's Table 2 numbers come from.

Written from ``eval_gsm8k.py`` and ``eval_math.py`` of github.com/meta-math/MetaMath
(nothing is imported or copied from them):

- **Prompt** (``gsm8k_test`` / ``test_hendrycks_math``: ``problem_prompt``): the Alpaca
  preamble, the question as the instruction, and a response that begins "Let's think step by
  step." -- :data:`PROMPT`. Zero-shot; the same for every model.
- **Decoding** (their ``SamplingParams``): greedy (temperature 0, top-p 1), at most 512 new
  tokens for GSM8K and 2,048 for MATH, stopping at any of :data:`STOP` (the stop string is not
  part of the output).
- **GSM8K answer** (``extract_answer_number``): see :func:`gsm8k_answer`; the reference is the
  integer after ``#### `` (``gsm8k_test``); equal when the two have the same value.
- **MATH answer** (``process_results``): see :func:`math_answer`; the reference is the content
  of the solution's last ``\\boxed{...}`` (``remove_boxed(util.last_boxed_only_string(...))``);
  compared with Hendrycks' ``is_equiv`` (:mod:`fedllm.evaluation.hendrycks_equiv`).
"""

from __future__ import annotations

import re
import unicodedata
from fractions import Fraction
from typing import Optional

PROMPT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response: Let's think step by step."
)
"""MetaMath's ``problem_prompt`` (both scripts)."""

STOP = ["Question:", "Question", "USER:", "USER", "ASSISTANT:", "ASSISTANT", "Instruction:", "Instruction",
        "Response:", "Response"]
"""MetaMath's ``stop_tokens`` (vLLM stop strings, both scripts)."""

GSM8K_MAX_NEW_TOKENS = 512
"""``eval_gsm8k.py``: ``max_tokens=512``."""

MATH_MAX_NEW_TOKENS = 2048
"""``eval_math.py``: ``max_tokens=2048``."""

ANSWER_MARK = "The answer is: "
"""What both scripts split a generation on (case and the colon matter)."""

_FIRST_NUMBER = re.compile(r"[-+]?\d*[.,/]?\d+")


def render(question: str) -> str:
    """The prompt MetaMath sends for ``question``."""
    return PROMPT.format(instruction=question)


def _numeric(text: str) -> bool:
    """``is_number`` of ``eval_gsm8k.py``: ``float()`` reads it, or it is a single numeric character."""
    try:
        float(text)
        return True
    except ValueError:
        pass
    try:
        unicodedata.numeric(text)
        return True
    except (TypeError, ValueError):
        return False


def gsm8k_answer(text: str) -> Optional[int]:
    """The integer MetaMath reads from a GSM8K generation, or None (scored wrong).

    Rules of ``extract_answer_number``: take the text after the *last* ``"The answer is: "``
    (None without one); its *first* number, an optional sign, digits, at most one ``.``, ``,``
    or ``/`` and more digits (so ``1,000,000`` reads as ``1,000``); commas dropped; a fraction
    ``a/b`` is ``round(a/b)`` (``a`` itself when ``b`` is 0; None when either side is not
    numeric); otherwise ``round()`` of the number (Python's, ties to even: 7.5 -> 8, 6.5 -> 6);
    None for an infinite value.
    """
    if ANSWER_MARK not in text:
        return None
    match = _FIRST_NUMBER.search(text.split(ANSWER_MARK)[-1].strip())
    if match is None:
        return None
    number = match.group()
    if "/" in number:
        numerator, denominator = number.split("/")
        if not (_numeric(numerator) and _numeric(denominator)):
            return None
        if denominator == "0":
            return round(float(numerator))
        try:
            return round(float(Fraction(number)))
        except (ValueError, ZeroDivisionError):  # "5/00", "٣/4": the reference script raises here
            return None
    value = float(number.replace(",", ""))
    return None if value == float("inf") else round(value)


def gsm8k_gold(solution: str) -> Optional[int]:
    """The reference integer of a GSM8K solution: after ``"#### "`` (``gsm8k_test``), commas dropped.

    MetaMathQA-style records without ``####`` fall back to :func:`gsm8k_answer` (MetaMath's script
    only reads GSM8K's own format).
    """
    if "#### " not in solution:
        return gsm8k_answer(solution)
    return int(solution.split("#### ")[1].replace(",", "").strip())


def gsm8k_equal(predicted: Optional[int], gold: Optional[int]) -> bool:
    """``float(y_pred) == float(answer)``; a missing prediction is wrong."""
    return predicted is not None and gold is not None and float(predicted) == float(gold)


def math_answer(text: str) -> Optional[str]:
    """The answer MetaMath reads from a MATH generation, or None (scored wrong).

    Rules of ``process_results``: the text after the *last* ``"The answer is: "`` (None without
    one), up to its first ``".\\n"``, stripped, without one trailing full stop, stripped again.
    A ``\\boxed{}`` is not looked for.
    """
    if ANSWER_MARK not in text:
        return None
    answer = text.split(ANSWER_MARK)[-1].split(".\n")[0].strip()
    if answer.endswith("."):
        answer = answer[:-1]
    return answer.strip()


def last_boxed(solution: str) -> Optional[str]:
    """``remove_boxed(last_boxed_only_string(solution))`` of MetaMath's ``util.py``.

    From the last ``\\boxed`` (else the last ``\\fbox``), characters are read until the brace
    count, raised by ``{`` and lowered by ``}``, comes back to 0 on a ``}``; the span must then
    read ``\\boxed{...}`` (so an ``\\fbox`` gives None) and its content is returned.
    """
    start = solution.rfind("\\boxed")
    if start < 0:
        start = solution.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for i in range(start, len(solution)):
        if solution[i] == "{":
            depth += 1
        elif solution[i] == "}":
            depth -= 1
            if depth == 0:
                span = solution[start:i + 1]
                head = "\\boxed{"
                return span[len(head):-1] if span.startswith(head) else None
    return None
