"""MATH (Hendrycks et al., 2021): competition mathematics, scored on the ``\\boxed{}`` answer.

Data: ``eval.data.math`` (file or hub id; records with ``problem`` and
``solution``, optionally ``answer``), else ``HuggingFaceH4/MATH-500`` (test
split). The reference answer is the record's ``answer``, else the last
``\\boxed{}`` of its solution; a generation's answer is its last ``\\boxed{}``,
else the text after "The answer is" (MetaMathQA style). Both are normalised
(:mod:`fedllm.evaluation.math_answer`) before comparison.
"""

from __future__ import annotations

from typing import Optional

from fedllm.evaluation.answer_task import AnswerTask
from fedllm.evaluation.math_answer import extract_math_answer, math_equal
from fedllm.evaluation.records import answer_of
from fedllm.evaluation.sources import HubSource
from fedllm.registry import register_task


@register_task("math")
class MATH(AnswerTask):
    """MATH accuracy."""

    name = "math"
    hub = HubSource("HuggingFaceH4/MATH-500", None, "test")

    def gold(self, record: dict) -> Optional[str]:
        answer = record.get("answer")
        if isinstance(answer, str) and answer.strip() and "\\boxed" not in answer:
            return answer.strip()
        return extract_math_answer(answer_of(record))

    def extract(self, text: str) -> Optional[str]:
        return extract_math_answer(text)

    def equal(self, predicted: Optional[str], gold: Optional[str]) -> bool:
        return math_equal(predicted, gold)
