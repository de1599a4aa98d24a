"""Vicuna bench (Chiang et al., 2023): 80 one-turn questions graded 1-10 by an LLM judge.

No installed package ships the questions, so ``eval.data.vicuna`` is required:
FastChat's ``vicuna_bench/question.jsonl`` (OpenFedLLM reads the same file), or its
directory (whose ``reference_answer/gpt-4.jsonl`` the ``fastchat`` protocol uses),
or any file or hub data set of records with ``turns`` (or ``text``/``question``) and
``category``. ``eval.limit`` takes a seeded sample stratified across the categories.

Two protocols (``eval.judge.protocol``):

- ``openfedllm`` (default; gives numbers comparable with the FRLoRA paper's, which
  follow OpenFedLLM): answers sampled at temperature 0.7, top-p 1.0, up to 2,048 new
  tokens; OpenFedLLM's single-answer judge prompt, no reference answers, judge
  temperature 0.2. (OpenFedLLM's ``show_results_vicuna.py`` averages an unparseable
  judgment in as -1: ``eval.judge.ratings: minus_one``; by default it is counted in
  ``unparsed`` and left out of the mean.)
- ``fastchat`` (comparable with FastChat's ``vicuna_bench`` numbers): answers at
  FastChat's per-category temperatures (0.7 for the Vicuna categories it does not
  list; math and coding greedy) with up to 1,024 new tokens; FastChat's
  ``single-v1`` prompt, and ``single-math-v1`` against the GPT-4 reference answers
  for math and coding questions; judge temperature 0.

A run trained with the Alpaca prompt is asked as the reference asks
(``eval.judged_prompts: reference``): ``openfedllm`` with OpenFedLLM's exact text
``...### Instruction:\n{q} \n\n### Response:`` and no stop string, ``fastchat`` through
FastChat's ``alpaca`` conversation template; ``training`` uses the run's own Alpaca prompt.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fedllm.common.registry import register_task
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judge_protocols import (
    FASTCHAT_SAMPLING,
    OPENFEDLLM_ALPACA_PROMPT,
    OPENFEDLLM_VICUNA_PROMPT,
    OPENFEDLLM_VICUNA_SAMPLING,
    AnswerSampling,
    SingleAnswerPrompt,
)
from fedllm.evaluation.judged_task import JudgedTask, read_reference_answers
from fedllm.evaluation.mtbench_assets import find_mt_bench
from fedllm.evaluation.prompt_styles import PromptStyle, ReferenceTemplateStyle, make_prompt_style
from fedllm.evaluation.records import question_of
from fedllm.evaluation.sources import DataSourceError, read_records
from fedllm.evaluation.tasks.mt_bench import FASTCHAT_ALPACA_TEMPLATE

PROTOCOLS: dict[str, tuple[AnswerSampling, Optional[SingleAnswerPrompt]]] = {
    "openfedllm": (OPENFEDLLM_VICUNA_SAMPLING, OPENFEDLLM_VICUNA_PROMPT),
    "fastchat": (FASTCHAT_SAMPLING, None),
}
"""``eval.judge.protocol`` -> (answer sampling, judge prompt; None: FastChat's prompts with references)."""


@register_task("vicuna")
class Vicuna(JudgedTask):
    """Vicuna bench mean rating (first turn only)."""

    name = "vicuna"

    def protocol(self, ctx: EvalContext) -> Optional[str]:
        return ctx.cfg.judge.protocol

    def reference_style(self, ctx: EvalContext) -> Optional[PromptStyle]:
        if ctx.prompt_style_name != "alpaca":
            return None
        if ctx.cfg.judge.protocol == "fastchat":
            return make_prompt_style("chat", ctx.tokenizer, FASTCHAT_ALPACA_TEMPLATE)
        return ReferenceTemplateStyle(ctx.tokenizer, OPENFEDLLM_ALPACA_PROMPT, "openfedllm-alpaca")

    def sampling(self, ctx: EvalContext) -> AnswerSampling:
        return PROTOCOLS[ctx.cfg.judge.protocol][0]

    def judge_prompt(self, ctx: EvalContext) -> Optional[SingleAnswerPrompt]:
        return PROTOCOLS[ctx.cfg.judge.protocol][1]

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
        for i, row in enumerate(rows):
            qid = row.get("question_id", i)
            turns = row.get("turns")
            question = turns[0] if isinstance(turns, list) and turns else question_of(row)
            ref = refs.get(qid) if self.judge_prompt(ctx) is None else None
            out.append({"id": qid, "category": row.get("category", "generic"), "turns": [question],
                        "references": ref[:1] if ref else None})
        return ctx.stratified(out, lambda ex: ex["category"])
