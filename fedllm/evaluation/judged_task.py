"""Open-ended tasks graded 1-10 by an LLM judge with FastChat's single-answer prompts.

Each example is a conversation of one or more user turns; turn ``t`` is
generated after the model's own answers to the earlier turns (batched over
examples, one turn at a time). Turn 1 is graded with ``single-v1`` (or
``single-math-v1`` against a reference answer), turn 2 with the multi-turn
prompts, which show the judge the whole conversation.
"""

from __future__ import annotations

import abc
import json
from pathlib import Path
from typing import Optional

from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.judge_prompts import (
    NEED_REF_CATEGORIES,
    grading_messages,
    load_judge_prompts,
    parse_rating,
    prompt_name,
)
from fedllm.evaluation.metrics import mean_rating
from fedllm.evaluation.mtbench_assets import find_judge_prompts
from fedllm.evaluation.results import ResultFile
from fedllm.evaluation.task import Task


class JudgedTask(Task):
    """Generate answers turn by turn, then ask the judge for a rating per turn.

    Attributes:
        always_reference: grade against the reference answer whenever an example has one
            (otherwise only for FastChat's reference categories: math, reasoning, coding).
    """

    always_reference: bool = False

    @abc.abstractmethod
    def examples(self, ctx: EvalContext) -> list[dict]:
        """``{"id", "category", "turns": [...], "references": [...] or None}`` per example.

        An example may also hold ``instruction`` and ``input`` (its first turn split the
        Alpaca way, used by the ``alpaca`` prompt style).
        """

    def summarize(self, ratings: list[list[float]]) -> dict[str, float]:
        """Metrics from the ratings of every example (one list of per-turn ratings each)."""
        flat = [r for per_example in ratings for r in per_example]
        return {"rating": mean_rating(flat), "unparsed": float(sum(r < 0 for r in flat))}

    # ----------------------------------------------------------------- generation

    def _generate_turns(self, ctx: EvalContext, examples: list[dict], results: ResultFile) -> None:
        ids = [ex["id"] for ex in examples]
        entries = {ex["id"]: {"id": ex["id"], "category": ex["category"], "turns": ex["turns"],
                              "prompts": [], "outputs": []} for ex in examples}
        for turn in range(max(len(ex["turns"]) for ex in examples)):
            todo, prompts = [], []
            for ex in examples:
                if turn >= len(ex["turns"]):
                    continue
                entry = entries[ex["id"]]
                messages = []
                for q, a in zip(ex["turns"][:turn], entry["outputs"], strict=True):
                    messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                user = {"role": "user", "content": ex["turns"][turn]}
                if turn == 0 and "instruction" in ex:
                    user.update(instruction=ex["instruction"], input=ex.get("input", ""))
                messages.append(user)
                prompt = ctx.style.render(messages)
                stored = results.get(ex["id"])
                if (stored and len(stored.get("prompts", [])) > turn and stored["prompts"][turn] == prompt
                        and stored.get("turns") == ex["turns"]):
                    entry["prompts"].append(prompt)
                    entry["outputs"].append(stored["outputs"][turn])
                    continue
                todo.append(ex["id"])
                prompts.append(prompt)

            def store(batch: list[int], outputs: list[str], todo=todo, prompts=prompts) -> None:
                for j, text in zip(batch, outputs, strict=True):
                    entry = entries[todo[j]]
                    entry["prompts"].append(prompts[j])
                    entry["outputs"].append(text)
                    results.put(dict(entry))
                results.save(ids)

            if todo:
                ctx.generate(prompts, on_batch=store, desc=f"{self.name} turn {turn + 1}")
        for entry in entries.values():
            stored = results.get(entry["id"])
            results.put({**(stored or {}), **entry})

    # ----------------------------------------------------------------- judging

    def _judge(self, ctx: EvalContext, examples: list[dict], results: ResultFile) -> list[list[float]]:
        prompts = load_judge_prompts(find_judge_prompts(ctx.data_spec("judge_prompts")))
        requests, where = [], []
        for ex in examples:
            entry = results.get(ex["id"])
            refs: Optional[list[str]] = ex.get("references")
            use_ref = bool(refs) and (self.always_reference or ex["category"] in NEED_REF_CATEGORIES)
            for turn in range(len(ex["turns"])):
                name = prompt_name(use_ref, multi_turn=turn > 0)
                msgs = grading_messages(prompts[name], ex["turns"][: turn + 1], entry["outputs"][: turn + 1],
                                        refs[: turn + 1] if use_ref else None)
                requests.append(msgs)
                where.append((entry, turn, name))
        judge = ctx.judge_client()
        replies = judge.judge_many(requests, desc=f"{self.name} judge")
        ratings: dict[int, list[float]] = {}
        for (entry, turn, name), msgs, reply in zip(where, requests, replies, strict=True):
            rating = parse_rating(reply, f"{self.name} example {entry['id']} turn {turn + 1}")
            judgments = entry.setdefault("judgments", [])
            del judgments[turn:]
            judgments.append({"judge_model": judge.model, "prompt_name": name, "judge_prompt": msgs[-1]["content"],
                              "judgment": reply, "rating": rating})
            ratings.setdefault(entry["id"], []).append(rating)
        return [ratings[ex["id"]] for ex in examples]

    def run(self, ctx: EvalContext) -> dict[str, float]:
        examples = self.examples(ctx)
        results = ctx.result_file(self.name, ctx.generation_settings())
        ids = [ex["id"] for ex in examples]
        self._generate_turns(ctx, examples, results)
        results.save(ids)
        ratings = self._judge(ctx, examples, results)
        results.metrics = self.summarize(ratings)
        results.save(ids)
        return dict(results.metrics)


def read_reference_answers(path: Optional[Path]) -> dict:
    """FastChat reference answers (``question_id -> [turn answers]``) of a ``gpt-4.jsonl`` file."""
    if path is None:
        return {}
    refs = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            refs[item["question_id"]] = item["choices"][0]["turns"]
    return refs
