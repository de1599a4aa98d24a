"""GSM8K (Cobbe et al., 2021): grade-school math word problems, zero- or k-shot chain of thought.

Data: ``eval.data.gsm8k`` (file or hub id), else the held-out training records
(GSM8K-format ``question``/``answer``), else ``openai/gsm8k`` (``main``, test
split). The reference answer is the number after ``####``; a generation's answer
is the number after ``####``, else after "The answer is", else its last number;
they compare numerically. ``eval.shots`` (0-8) puts Wei et al.'s exemplars first.
That is the ``fedllm`` answer protocol; ``metamath`` and ``lm_eval`` (``eval.answer_protocol``)
run MetaMath's ``eval_gsm8k.py`` rules and lm-evaluation-harness's ``gsm8k`` task.
"""

from __future__ import annotations

from typing import Optional

from fedllm.common.errors import InputError
from fedllm.common.registry import register_task
from fedllm.evaluation import metamath_rules
from fedllm.evaluation.answer_task import AnswerRules, AnswerTask
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.numeric_answer import extract_number, numbers_equal
from fedllm.evaluation.records import answer_of
from fedllm.evaluation.sources import HubSource
from fedllm.evaluation.tasks.gsm8k_exemplars import GSM8K_COT_EXEMPLARS


@register_task("gsm8k")
class GSM8K(AnswerTask):
    """GSM8K accuracy."""

    name = "gsm8k"
    hub = HubSource("openai/gsm8k", "main", "test")
    uses_records = True
    lm_eval_task = "gsm8k"
    lm_eval_folder = "gsm8k"

    def gold(self, record: dict) -> Optional[str]:
        return extract_number(answer_of(record))

    def extract(self, text: str) -> Optional[str]:
        return extract_number(text)

    def equal(self, predicted: Optional[str], gold: Optional[str]) -> bool:
        return numbers_equal(predicted, gold)

    def metamath(self) -> AnswerRules:
        return AnswerRules(gold=lambda record: metamath_rules.gsm8k_gold(answer_of(record)),
                           extract=metamath_rules.gsm8k_answer, equal=metamath_rules.gsm8k_equal,
                           max_new_tokens=metamath_rules.GSM8K_MAX_NEW_TOKENS, prompt=metamath_rules.render,
                           stop=metamath_rules.STOP, name="metamath")

    def exemplars(self, ctx: EvalContext) -> list[tuple[str, str]]:
        if not 0 <= ctx.cfg.shots <= len(GSM8K_COT_EXEMPLARS):
            raise InputError(f"eval.shots must be in 0..{len(GSM8K_COT_EXEMPLARS)} for gsm8k, got {ctx.cfg.shots}")
        return GSM8K_COT_EXEMPLARS[: ctx.cfg.shots]
