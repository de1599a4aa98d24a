"""FlowerTune LLM leaderboard scoring: answer extraction of the text challenges and pass@k of the code challenge.

General NLP and Medical (``utils.format_answer``, ``benchmarks.accuracy_compute``): output and reference are
lower-cased; when the output contains ``\\n##`` only the line after it is read; every non-alphanumeric
character becomes a space, runs of spaces collapse; a boolean answer has ``yesyes``/``nono``/``yesno``/``noyes``
folded (first match only), a multiple-choice answer keeps its first character, both drop non-ASCII characters.
If the result is one of ``a b c d e yes no`` it is the prediction; otherwise the prediction is the whole
lower-cased output. Correct when prediction == reference (so PubMedQA's ``maybe`` only matches an output that is
exactly ``maybe``).

Finance (``benchmarks.inference``, ``utils.change_target``): the generated text is the decoded prompt and
continuation split at ``"Answer: "`` (the piece after the first one, up to a second one; ``None`` when absent);
it is ``positive`` if it contains ``positive``/``Positive``, else ``negative`` if it contains
``negative``/``Negative``, else ``neutral``.

Code (bigcode-evaluation-harness ``estimate_pass_at_k``, Chen et al. 2021, Eq. 1): with ``n`` samples of which
``c`` pass, ``pass@k = 1 - C(n-c, k) / C(n, k)``, averaged over problems.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from math import comb

ANSWER_WORDS = ("a", "b", "c", "d", "e", "yes", "no")
_BOOLEAN_FOLDS = (("yesyes", "yes"), ("nono", "no"), ("yesno", "yes"), ("noyes", "no"))


def choice_prediction(output: str, gold: str, answer_type: str) -> tuple[str, str]:
    """``(prediction, reference)`` as FlowerTune compares them; both lower-cased.

    Args:
        output: the generated text.
        gold: the reference answer (a letter, or yes/no/maybe).
        answer_type: ``mcq`` or ``boolean``.
    """
    text, reference = output.lower(), gold.lower()
    fallback = (text, reference)
    if "\n##" in text:
        text = text.split("\n##")[1].split("\n")[0].strip().lower()
    if "###" in reference:
        parts = reference.split("answer is:")
        if len(parts) < 2:
            return fallback
        reference = parts[1].split("###")[0].strip()
    text = re.sub(" +", " ", re.sub(r"[^a-zA-Z0-9]", " ", text).strip())
    if answer_type == "boolean":
        for pair, folded in _BOOLEAN_FOLDS:
            if pair in text:
                text = text.replace(pair, folded)
                break
        text = text.encode("ascii", "ignore").decode("ascii")
    elif answer_type == "mcq":
        text = text.encode("ascii", "ignore").decode("ascii")[:1]
    return (text, reference) if text in ANSWER_WORDS else fallback


def choice_correct(output: str, gold: str | None, answer_type: str) -> bool:
    """Whether FlowerTune counts ``output`` correct (a record without a reference never is)."""
    if gold is None:
        return False
    prediction, reference = choice_prediction(output, gold, answer_type)
    return prediction == reference


def finance_answer(decoded: str) -> str:
    """The answer text FlowerTune reads from the decoded prompt + continuation."""
    pieces = decoded.split("Answer: ")
    return pieces[1] if len(pieces) > 1 else "None"


def sentiment_label(text: str) -> str:
    """``positive``, ``negative`` or ``neutral`` by FlowerTune's keyword rule (``change_target``)."""
    if "positive" in text or "Positive" in text:
        return "positive"
    if "negative" in text or "Negative" in text:
        return "negative"
    return "neutral"


def pass_at_k(samples: int, passed: int, k: int) -> float:
    """Unbiased pass@k of one problem (Chen et al. 2021, Eq. 1)."""
    if samples - passed < k:
        return 1.0
    return 1.0 - comb(samples - passed, k) / comb(samples, k)


def mean_pass_at_k(passed_per_problem: Sequence[Sequence[bool]], k: int = 1) -> float:
    """Mean pass@k over problems, each given as the verdicts of its samples (0.0 for none)."""
    if not passed_per_problem:
        return 0.0
    return sum(pass_at_k(len(v), sum(map(bool, v)), k) for v in passed_per_problem) / len(passed_per_problem)
