"""MT-Bench (Zheng et al., 2023): 80 two-turn questions graded 1-10 by an LLM judge.

Run as FastChat's ``llm_judge`` runs it (and OpenFedLLM, whose MT-Bench protocol
the FRLoRA paper follows): answers sampled at FastChat's per-category temperature
(writing/roleplay 0.7, STEM/humanities 0.1, the rest greedy; seeded with
``eval.seed``) with up to 1,024 new tokens; the second turn is generated after
the model's own first answer. Grading is FastChat's single-answer grading at judge
temperature 0; math, reasoning and coding questions are graded against GPT-4's
reference answers. ``eval.limit`` takes a seeded sample stratified across the
categories (a limit of 8 covers all of them). Metrics as in FRLoRA's Table 2:
``mt1`` (mean first-turn rating), ``mt2`` (second turn) and ``avg`` (mean of
all ratings); ``unparsed`` counts judgments without a rating (rated -1, left
out of the means unless ``eval.judge.ratings: minus_one``).

A run trained with the Alpaca prompt is asked both turns through FastChat's ``alpaca``
conversation template (as OpenFedLLM's ``gen_model_answer_mt.py`` builds them);
``eval.judged_prompts: training`` re-sends the run's Alpaca prompt for each turn instead.
Sampling: top-p from the model's generation config (FastChat passes none); each question
seeded once with ``eval.seed`` and both turns drawn from that one stream, as FastChat's
``gen_model_answer.py`` (``torch.manual_seed(0)`` per question) does (``eval.seeding: batch``:
batched, one seed per batch).
"""

from __future__ import annotations

import json
from typing import Optional

from fedllm.common.registry import register_task
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judged_task import JudgedTask, read_reference_answers
from fedllm.evaluation.mtbench_assets import find_mt_bench
from fedllm.evaluation.prompt_styles import PromptStyle, make_prompt_style

FASTCHAT_ALPACA_TEMPLATE = "alpaca"
"""The FastChat conversation template of a run trained with the Alpaca prompt (``eval.judged_prompts:
reference``): OpenFedLLM's ``gen_model_answer_mt.py`` builds both turns with FastChat's
``get_conv_template(args.template)``, so the second turn sees the first as a conversation."""


def read_questions(path) -> list[dict]:
    """Question records of a FastChat ``question.jsonl``."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@register_task("mt_bench")
class MTBench(JudgedTask):
    """MT-Bench MT-1, MT-2 and their average."""

    name = "mt_bench"

    def examples(self, ctx: EvalContext) -> list[dict]:
        files = find_mt_bench(ctx.data_spec(self.name))
        refs = read_reference_answers(files.references)
        return [{"id": q["question_id"], "category": q["category"], "turns": list(q["turns"]),
                 "references": refs.get(q["question_id"])}
                for q in ctx.stratified(read_questions(files.questions), lambda q: q["category"])]

    def reference_style(self, ctx: EvalContext) -> Optional[PromptStyle]:
        if ctx.prompt_style_name == "alpaca":
            return make_prompt_style("chat", ctx.tokenizer, FASTCHAT_ALPACA_TEMPLATE)
        return None

    def summarize(self, ctx: EvalContext, ratings: list[list[float]]) -> dict[str, float]:
        first = [r[0] for r in ratings]
        second = [r[1] for r in ratings if len(r) > 1]
        flat = first + second
        return {"mt1": self.mean(ctx, first), "mt2": self.mean(ctx, second), "avg": self.mean(ctx, flat),
                "unparsed": float(sum(r < 0 for r in flat))}
