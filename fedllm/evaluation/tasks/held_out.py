"""``held_out``: the run's own held-out records — its loss, and its answer accuracy where the answers have one.

The default evaluation of a recipe that holds records out (``data.eval_fraction``, ``data.eval_path`` or
``data.eval_split``) and names no ``eval.tasks``: a user's own data has no benchmark, but its held-out part tells
whether the federation learnt it.

* instruction and chat data: ``loss``, the mean next-token cross-entropy over the supervised (answer) tokens of
  every held-out record, pooled over tokens as training pools them, and ``perplexity`` = ``exp(loss)``; when every
  held-out answer ends in GSM8K's final-answer line (``#### 42``), also ``answer_accuracy``: the model's greedy
  answer to each question scored by the ``gsm8k`` task's rules (its number after ``####``, else after "The
  answer is", else its last number, compared numerically);
* classification data: ``loss`` (cross-entropy of the label) and ``accuracy``.

Preference pairs have their own held-out measure, ``pref_accuracy``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

import torch
import torch.nn.functional as F

from fedllm.common.registry import register_task
from fedllm.data.collate import collate
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.records import answer_of
from fedllm.evaluation.sources import DataSourceError
from fedllm.evaluation.task import Task
from fedllm.evaluation.tasks.gsm8k import GSM8K

FINAL_ANSWER = re.compile(r"####\s*-?[\d,]*\.?\d")
"""GSM8K's final-answer line: an answer that has one can be scored by exact match."""


def has_final_answer(record: dict) -> bool:
    """Whether ``record``'s reference answer ends its reasoning with ``#### <number>``."""
    try:
        return bool(FINAL_ANSWER.search(answer_of(record) or ""))
    except DataSourceError:
        return False


class HeldOutAnswers(GSM8K):
    """GSM8K's answer rules on the run's held-out records (never its hub data, never ``eval.data.gsm8k``)."""

    name = "held_out_answers"

    def raw_records(self, ctx: EvalContext) -> list[dict]:
        return list(ctx.records or [])


@register_task("held_out")
class HeldOut(Task):
    """Loss (and answer accuracy where the answers have one) on the run's held-out records."""

    name = "held_out"
    uses_records = True

    def run(self, ctx: EvalContext) -> dict[str, float]:
        examples = ctx.limited(list(ctx.eval_examples or []))
        if not examples:
            raise DataSourceError("held_out scores the run's held-out records: give data.eval_fraction > 0, "
                                  "data.eval_path or data.eval_split (the run holds no record out)")
        if "rejected_input_ids" in examples[0]:
            raise DataSourceError("held_out scores instruction, chat and classification records; held-out "
                                  "preference pairs are scored by pref_accuracy")
        classes = "label" in examples[0]
        sums = _classification_sums(ctx, examples) if classes else _token_sums(ctx, examples)
        loss = sums["loss"] / sums["count"]
        metrics = {"loss": loss, **({"accuracy": sums["correct"] / sums["count"]} if classes
                                    else {"perplexity": math.exp(min(loss, 700.0))})}
        records = ctx.limited(list(ctx.records or []))
        if not classes and records and all(has_final_answer(r) for r in records):
            answers = dataclasses.replace(ctx, cfg=dataclasses.replace(ctx.cfg, answer_protocol="fedllm", shots=0))
            metrics["answer_accuracy"] = HeldOutAnswers().run(answers)["accuracy"]
        results = ctx.result_file(self.name, {"model": ctx.fingerprint, "examples": len(examples),
                                              "counted": int(sums["count"])})
        results.metrics = dict(metrics)
        results.save([])
        return metrics


def _batches(ctx: EvalContext, examples: list[dict], task: str):
    """Collated batches of ``examples`` on the model's device, the model in eval mode and without gradients."""
    model, device = ctx.model, next(ctx.model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(examples), ctx.cfg.batch_size):
                batch = collate(examples[start : start + ctx.cfg.batch_size], _pad_id(ctx), task)
                yield {k: v.to(device) for k, v in batch.items()}
    finally:
        model.train(was_training)


def _pad_id(ctx: EvalContext) -> int:
    pad: Optional[int] = ctx.tokenizer.pad_token_id
    return int(pad if pad is not None else ctx.tokenizer.eos_token_id)


def _token_sums(ctx: EvalContext, examples: list[dict]) -> dict[str, float]:
    """Summed next-token cross-entropy over the supervised tokens, and their count."""
    loss, count = 0.0, 0
    for batch in _batches(ctx, examples, "causal_lm"):
        logits = ctx.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        labels = batch["labels"][:, 1:]
        loss += F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels.flatten(),
                                ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += int((labels != IGNORE_INDEX).sum())
    if not count:
        raise DataSourceError("held_out: no held-out record has a supervised token left (raise train.max_length)")
    return {"loss": loss, "count": count}


def _classification_sums(ctx: EvalContext, examples: list[dict]) -> dict[str, float]:
    """Summed cross-entropy of the labels, the number right, and the number of examples."""
    loss, correct = 0.0, 0
    for batch in _batches(ctx, examples, "classification"):
        logits = ctx.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
        loss += F.cross_entropy(logits, batch["labels"], reduction="sum").item()
        correct += int((logits.argmax(-1) == batch["labels"]).sum())
    return {"loss": loss, "count": len(examples), "correct": correct}
