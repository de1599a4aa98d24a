"""Ref-GPT4 (Ye et al., 2024, FedLLM-Bench): held-out training samples judged against their references.

Fifty unseen samples (``eval.limit`` if set) are drawn with a fixed seed from
``eval.data.ref_gpt4`` (file or hub id) or from the held-out training records;
the model answers each instruction and the judge rates the answer 1-10 against
the record's reference response (FastChat's reference-based ``single-math-v1``
prompt).
"""

from __future__ import annotations

import random

from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judged_task import JudgedTask
from fedllm.evaluation.records import answer_of, instruction_and_input, question_of
from fedllm.evaluation.sources import DataSourceError
from fedllm.registry import register_task

SAMPLES = 50
"""Held-out samples judged (FedLLM-Bench's protocol)."""

SEED = 0
"""Seed of the sample draw, so every evaluation of a run judges the same samples."""


@register_task("ref_gpt4")
class RefGPT4(JudgedTask):
    """Mean judge rating against the training set's reference answers."""

    name = "ref_gpt4"
    uses_records = True
    always_reference = True

    def examples(self, ctx: EvalContext) -> list[dict]:
        if not ctx.data_spec(self.name) and not ctx.records:
            raise DataSourceError("ref_gpt4 needs held-out training records (data.eval_fraction or data.eval_path) "
                                  "or --data ref_gpt4=PATH_OR_HUB_ID")
        rows = self.raw_records(ctx)
        n = min(len(rows), ctx.cfg.limit if ctx.cfg.limit is not None else SAMPLES)
        picked = sorted(random.Random(SEED).sample(range(len(rows)), n))
        out = []
        for i in picked:
            instruction, inp = instruction_and_input(rows[i])
            out.append({"id": i, "category": rows[i].get("category", "general"), "turns": [question_of(rows[i])],
                        "references": [answer_of(rows[i])], "instruction": instruction, "input": inp})
        return out
