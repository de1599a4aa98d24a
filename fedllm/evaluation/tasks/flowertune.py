"""FlowerTune LLM leaderboard (Flower; ``benchmarks/flowertune-llm/evaluation``): General NLP, Medical, Finance.

Each challenge is one task whose metrics are the board's columns (accuracy of each data set, as a fraction; the
board prints percentages) and their ``average``, by which the board ranks. Prompts, answer extraction, decoding
and the rows evaluated are FlowerTune's (:mod:`~fedllm.evaluation.flowertune_prompts`,
:mod:`~fedllm.evaluation.flowertune_scoring`, :mod:`~fedllm.evaluation.flowertune_generation`,
:mod:`~fedllm.evaluation.flowertune_data`); the board evaluates the model loaded in 4-bit
(``eval.quantization``: :mod:`~fedllm.evaluation.flowertune_quantization`). The code challenge is
:mod:`fedllm.evaluation.tasks.flowertune_code`.
"""

from __future__ import annotations

import abc
from typing import Any

from fedllm.common.registry import register_task
from fedllm.evaluation import flowertune_generation as gen
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.flowertune_data import question_rows
from fedllm.evaluation.flowertune_prompts import FINANCE_SETS, MEDICAL_SETS, QuestionSet, mmlu_set
from fedllm.evaluation.flowertune_quantization import quantization_settings
from fedllm.evaluation.flowertune_scoring import choice_correct, finance_answer, sentiment_label
from fedllm.evaluation.metrics import accuracy
from fedllm.evaluation.task import Task


class FlowerTuneChallenge(Task):
    """A challenge of text data sets; subclasses say how one data set's answers are generated."""

    sets: tuple[QuestionSet, ...] = ()

    def protocol(self, ctx: EvalContext) -> str:
        return "flowertune"

    @abc.abstractmethod
    def answers(self, ctx: EvalContext, prompts: list[str], golds: list[str], todo: list[int]) -> dict[int, str]:
        """The generated answer text (what the scorer reads) of the prompts ``todo`` indexes, by index: ``prompts``
        and ``golds`` are the data set's full rows, whose order fixes the batches (a resumed run's answers are an
        uninterrupted one's)."""

    @abc.abstractmethod
    def row_settings(self, ctx: EvalContext, prompts: list[str], golds: list[str]) -> list[dict]:
        """What each row's answer depends on besides its prompt (its batch of the full row order), stored with
        the answer: a stored answer is reused only where they are the same (a ``--limit`` run's rows may sit in
        a smaller batch than a full run's)."""

    def correct(self, qs: QuestionSet, answer: str, gold: Any) -> bool:
        """FlowerTune's verdict on one answer."""
        return choice_correct(answer, gold, qs.answer_type)

    def run(self, ctx: EvalContext) -> dict[str, float]:
        settings = {"model": ctx.fingerprint, "protocol": "flowertune",
                    **quantization_settings(ctx.model, ctx.cfg.quantization)}
        results = ctx.result_file(self.name, settings)
        metrics: dict[str, float] = {}
        order: list[str] = []
        for qs in self.sets:
            rows = question_rows(ctx, self.name, qs)
            ids = [f"{qs.key}/{i}" for i in range(len(rows))]
            prompts, golds = [qs.prompt(r) for r in rows], [qs.gold(r) for r in rows]
            order += ids
            keys = self.row_settings(ctx, prompts, golds)
            todo = [i for i, (id_, p, key) in enumerate(zip(ids, prompts, keys, strict=True))
                    if results.get(id_, prompt=p, **key) is None]
            if todo:
                answers = self.answers(ctx, prompts, golds, todo)
                for i in todo:
                    results.put({"id": ids[i], "set": qs.key, "prompt": prompts[i], "gold": golds[i], **keys[i],
                                 "output": answers[i]})
                results.save(order)
            verdicts = []
            for id_, gold in zip(ids, golds, strict=True):
                entry = results.get(id_)
                entry["correct"] = self.correct(qs, entry["output"], gold)
                verdicts.append(entry["correct"])
            metrics[qs.key] = accuracy(verdicts)
        metrics["average"] = sum(metrics[qs.key] for qs in self.sets) / len(self.sets)
        results.metrics = metrics
        results.save(order)
        return dict(metrics)


class ChoiceChallenge(FlowerTuneChallenge):
    """General NLP and Medical: one greedy answer per question, as long as the first reference of its batch of 16."""

    @staticmethod
    def _limits(ctx: EvalContext, golds: list[str]) -> list[int]:
        return gen.choice_token_limits(ctx.tokenizer, [g if g is not None else "" for g in golds])

    def row_settings(self, ctx: EvalContext, prompts: list[str], golds: list[str]) -> list[dict]:
        return [{"max_new_tokens": n} for n in self._limits(ctx, golds)]

    def answers(self, ctx: EvalContext, prompts: list[str], golds: list[str], todo: list[int]) -> dict[int, str]:
        limits = self._limits(ctx, golds)
        return {i: gen.greedy_each(ctx.model, ctx.tokenizer, prompts[i], limits[i]) for i in todo}


@register_task("flowertune_general_nlp")
class FlowerTuneGeneralNLP(ChoiceChallenge):
    """FlowerTune General NLP: MMLU STEM, social sciences and humanities (``lukaemon/mmlu``), accuracy and average."""

    name = "flowertune_general_nlp"
    sets = tuple(mmlu_set(c) for c in ("stem", "social_sciences", "humanities"))


@register_task("flowertune_medical")
class FlowerTuneMedical(ChoiceChallenge):
    """FlowerTune Medical: PubMedQA, MedMCQA, MedQA, CareQA accuracy and their average."""

    name = "flowertune_medical"
    sets = MEDICAL_SETS


@register_task("flowertune_finance")
class FlowerTuneFinance(FlowerTuneChallenge):
    """FlowerTune Finance: FPB, FiQA, TFNS sentiment accuracy and their average."""

    name = "flowertune_finance"
    sets = FINANCE_SETS

    def row_settings(self, ctx: EvalContext, prompts: list[str], golds: list[str]) -> list[dict]:
        return [{"batch": list(gen.finance_batch(i, len(prompts)))} for i in range(len(prompts))]

    def answers(self, ctx: EvalContext, prompts: list[str], golds: list[str], todo: list[int]) -> dict[int, str]:
        rows = gen.finance_decoded(ctx.model, ctx.tokenizer, prompts, todo=todo)
        return {i: finance_answer(rows[i]) for i in todo}

    def correct(self, qs: QuestionSet, answer: str, gold: Any) -> bool:
        return sentiment_label(answer) == sentiment_label(gold)
