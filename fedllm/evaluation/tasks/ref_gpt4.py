"""Ref-GPT4 (Ye et al., 2024, FedLLM-Bench): a fixed set of instructions, answers graded 1-10 by a judge.

What this task does, step by step (FedLLM-Bench's ``gen_answer_bench.py``,
``gen_judge_bench.py`` and ``show_results_bench.py``):

1. Instructions: ``eval.data.ref_gpt4`` in FedLLM-Bench's ``testset.json`` format (a
   JSON list of ``{"instruction": ...}``, e.g. ``evaluation/open_ended/data/chatbot/
   testset.json``; a directory holding ``testset.json`` works too; any records file or
   hub id with an instruction field is read the same way), all of them in file order.
   Without that file, 50 held-out training records of the run are drawn with seed 0
   (a fallback that is *not* FedLLM-Bench's test set: numbers are then comparable only
   between runs on the same data split). ``eval.limit`` takes a seeded sample.
2. Answers: one per instruction, sampled at temperature 0.7, top-p 1.0, up to 1,024
   new tokens (each seeded with ``eval.seed``; greedy with ``eval.decoding: greedy``).
   A run trained with the Alpaca prompt is asked with FedLLM-Bench's exact text
   ``...### Instruction:\n{instruction} \n\n### Response:`` (the instruction alone, no stop
   string; ``eval.judged_prompts: training``: the run's own Alpaca prompt); other runs in
   their prompt style.
3. Grading: FedLLM-Bench's single-answer prompt (system "You are a helpful assistant,
   that rates models by the quality of their answers."), with the instruction and the
   answer only: **no reference answer** is shown, despite the name. Judge temperature
   0.2, up to 2,048 reply tokens.
4. Score: ``[[x]]`` (else ``[x]``) in the reply; ``rating`` is the mean over the
   parsed replies, ``unparsed`` counts the others (FedLLM-Bench skips them too).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

from fedllm.common.registry import register_task
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judge_protocols import (
    FEDLLM_BENCH_PROMPT,
    FEDLLM_BENCH_SAMPLING,
    OPENFEDLLM_ALPACA_PROMPT,
    AnswerSampling,
    SingleAnswerPrompt,
)
from fedllm.evaluation.judged_task import JudgedTask
from fedllm.evaluation.prompt_styles import PromptStyle, ReferenceTemplateStyle
from fedllm.evaluation.records import instruction_and_input, question_of
from fedllm.evaluation.sources import DataSourceError, read_records

SAMPLES = 50
"""Held-out records drawn when no ``testset.json`` is given (the size of FedLLM-Bench's test files)."""

SEED = 0
"""Seed of that draw, so every evaluation of a run judges the same records."""

TESTSET_FILE = "testset.json"
"""FedLLM-Bench's test file name inside a benchmark's data directory."""


def read_testset(spec: str) -> list[dict]:
    """Records of a FedLLM-Bench ``testset.json`` (or a directory holding one, or any records file / hub id)."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / TESTSET_FILE).is_file():
        path = path / TESTSET_FILE
    return read_records(str(path) if path.exists() else spec)


@register_task("ref_gpt4")
class RefGPT4(JudgedTask):
    """Mean judge rating of the answers to FedLLM-Bench's test instructions."""

    name = "ref_gpt4"
    uses_records = True
    reference = "fedllm-bench"

    def reference_style(self, ctx: EvalContext) -> Optional[PromptStyle]:
        if ctx.prompt_style_name == "alpaca":
            return ReferenceTemplateStyle(ctx.tokenizer, OPENFEDLLM_ALPACA_PROMPT, "openfedllm-alpaca")
        return None

    def sampling(self, ctx: EvalContext) -> AnswerSampling:
        return FEDLLM_BENCH_SAMPLING

    def judge_prompt(self, ctx: EvalContext) -> Optional[SingleAnswerPrompt]:
        return FEDLLM_BENCH_PROMPT

    def examples(self, ctx: EvalContext) -> list[dict]:
        spec = ctx.data_spec(self.name)
        if spec:
            rows = read_testset(spec)
            picked = range(len(rows))
        elif ctx.records:
            rows = list(ctx.records)
            picked = sorted(random.Random(SEED).sample(range(len(rows)), min(len(rows), SAMPLES)))
        else:
            raise DataSourceError("ref_gpt4 needs FedLLM-Bench's test instructions (--data ref_gpt4=PATH/testset.json, "
                                  "eval.data.ref_gpt4) or held-out training records (data.eval_fraction or "
                                  "data.eval_path)")
        out = []
        for i in picked:
            instruction, inp = instruction_and_input(rows[i])
            out.append({"id": i, "category": rows[i].get("category", "general"), "turns": [question_of(rows[i])],
                        "references": None, "instruction": instruction, "input": inp})
        return ctx.stratified(out, lambda ex: ex["category"])
