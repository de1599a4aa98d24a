"""Vicuna bench (Chiang et al., 2023): 80 one-turn questions graded 1-10 by an LLM judge.

No installed package ships the questions, so ``eval.data.vicuna`` is required:
FastChat's ``vicuna_bench/question.jsonl`` (or its directory, whose
``reference_answer/gpt-4.jsonl`` is then used for math and coding questions),
any file or hub data set of records with ``turns`` (or ``text``/``question``) and
``category``.
"""

from __future__ import annotations

from pathlib import Path

from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judged_task import JudgedTask, read_reference_answers
from fedllm.evaluation.mtbench_assets import find_mt_bench
from fedllm.evaluation.records import question_of
from fedllm.evaluation.sources import DataSourceError, read_records
from fedllm.registry import register_task


@register_task("vicuna")
class Vicuna(JudgedTask):
    """Vicuna bench mean rating (first turn only)."""

    name = "vicuna"

    def examples(self, ctx: EvalContext) -> list[dict]:
        spec = ctx.data_spec(self.name)
        if not spec:
            raise DataSourceError("vicuna needs its questions: --data vicuna=PATH (FastChat's vicuna_bench "
                                  "question.jsonl or its directory) or a hub id (eval.data.vicuna)")
        refs: dict = {}
        if Path(spec).expanduser().exists():
            files = find_mt_bench(spec)
            rows = read_records(str(files.questions))
            refs = read_reference_answers(files.references)
        else:
            rows = read_records(spec, "train")
        out = []
        for i, row in enumerate(ctx.limited(rows)):
            qid = row.get("question_id", i)
            turns = row.get("turns")
            question = turns[0] if isinstance(turns, list) and turns else question_of(row)
            ref = refs.get(qid)
            out.append({"id": qid, "category": row.get("category", "generic"), "turns": [question],
                        "references": ref[:1] if ref else None})
        return out
