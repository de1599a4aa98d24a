"""Tasks scored by comparing an extracted final answer with the reference (GSM8K, MATH).

Each runs under one of three answer protocols (``eval.answer_protocol``; eval/README.md):

- ``fedllm``: the run's prompt style, the task's own extraction and equality
  (:meth:`AnswerTask.extract`, :meth:`AnswerTask.equal`), the most lenient correct scorer;
- ``metamath``: MetaMath's prompt, decoding and scoring (:meth:`AnswerTask.metamath`);
- ``lm_eval``: the lm-evaluation-harness task :attr:`AnswerTask.lm_eval_task`, run by the
  harness itself (:mod:`fedllm.evaluation.harness`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fedllm.common.errors import InputError
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.metrics import accuracy
from fedllm.evaluation.records import instruction_and_input, question_of
from fedllm.evaluation.task import Task


@dataclass(frozen=True)
class AnswerRules:
    """How one protocol prompts, decodes and scores an answer task.

    Attributes:
        gold: raw record -> reference answer.
        extract: generated text -> answer (None: no answer, wrong).
        equal: (predicted, reference) -> verdict.
        max_new_tokens: the protocol's generation limit.
        prompt: question -> full prompt text; None renders the run's prompt style (with exemplars).
        stop: stop strings; None: the prompt style's.
        name: recorded as the result file's ``prompt_style`` when ``prompt`` is set.
    """

    gold: Callable[[dict], Any]
    extract: Callable[[str], Any]
    equal: Callable[[Any, Any], bool]
    max_new_tokens: int
    prompt: Optional[Callable[[str], str]] = None
    stop: Optional[list[str]] = None
    name: str = ""


class AnswerTask(Task):
    """Generate a solution per question; correct when its final answer equals the reference answer.

    Subclasses define the ``fedllm`` protocol's reading of the reference (:meth:`gold`),
    extraction (:meth:`extract`) and equality (:meth:`equal`), optionally few-shot exemplars
    (:meth:`exemplars`), MetaMath's rules (:meth:`metamath`) and the harness task
    (:attr:`lm_eval_task`).
    """

    lm_eval_task: str = ""
    """lm-evaluation-harness task (or group) of the ``lm_eval`` protocol."""

    lm_eval_folder: str = ""
    """The harness's folder (``lm_eval/tasks/<folder>``) defining :attr:`lm_eval_task`: only it is indexed."""

    max_new_tokens: int = 512
    """The ``fedllm`` protocol's generation limit (greedy)."""

    @abc.abstractmethod
    def gold(self, record: dict) -> Optional[str]:
        """The reference final answer of a raw record."""

    @abc.abstractmethod
    def extract(self, text: str) -> Optional[str]:
        """The final answer in a generated text."""

    @abc.abstractmethod
    def equal(self, predicted: Optional[str], gold: Optional[str]) -> bool:
        """Whether a predicted answer matches the reference."""

    @abc.abstractmethod
    def metamath(self) -> AnswerRules:
        """MetaMath's rules for this task (:mod:`fedllm.evaluation.metamath_rules`)."""

    def rules(self, protocol: str) -> AnswerRules:
        """The rules of ``protocol`` (``fedllm`` or ``metamath``)."""
        if protocol == "metamath":
            return self.metamath()
        return AnswerRules(self.gold, self.extract, self.equal, self.max_new_tokens)

    def exemplars(self, ctx: EvalContext) -> list[tuple[str, str]]:
        """Few-shot ``(question, worked answer)`` pairs put before each question."""
        return []

    def examples(self, ctx: EvalContext, rules: Optional[AnswerRules] = None) -> list[dict]:
        """``{"id", "question", "instruction", "input", "gold"}`` per evaluated record."""
        gold = (rules or self.rules("fedllm")).gold
        out = []
        for i, rec in enumerate(ctx.limited(self.raw_records(ctx))):
            instruction, inp = instruction_and_input(rec)
            out.append({"id": i, "question": question_of(rec),
                        "instruction": instruction, "input": inp, "gold": gold(rec)})
        return out

    def messages(self, ctx: EvalContext, example: dict) -> list[dict]:
        """The conversation of one question: the exemplars as previous turns, then the question."""
        msgs: list[dict] = []
        for q, a in self.exemplars(ctx):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": example["question"],
                     "instruction": example["instruction"], "input": example["input"]})
        return msgs

    def protocol(self, ctx: EvalContext) -> Optional[str]:
        return ctx.cfg.answer_protocol

    def run_lm_eval(self, ctx: EvalContext) -> dict[str, float]:
        """The ``lm_eval`` protocol: the harness runs :attr:`lm_eval_task` on ``eval.data.<name>`` or its own data."""
        from fedllm.evaluation.harness import run_harness_task

        return run_harness_task(ctx, self.name, self.lm_eval_task, data_spec=ctx.data_spec(self.name),
                                home=self.lm_eval_folder or None)

    def run(self, ctx: EvalContext) -> dict[str, float]:
        protocol = ctx.cfg.answer_protocol
        if protocol == "lm_eval":
            return self.run_lm_eval(ctx)
        rules = self.rules(protocol)
        if rules.prompt is not None and ctx.cfg.shots:
            raise InputError(f"eval.shots={ctx.cfg.shots}: the {protocol} answer protocol is zero-shot "
                             f"(set eval.shots to 0, or use eval.answer_protocol=fedllm)")
        examples = self.examples(ctx, rules)
        if rules.prompt is not None:
            prompts = [rules.prompt(ex["question"]) for ex in examples]
        else:
            prompts = [ctx.style.render(self.messages(ctx, ex)) for ex in examples]
        stop = rules.stop if rules.stop is not None else ctx.style.stop
        max_new_tokens = ctx.max_new_tokens(rules.max_new_tokens)
        settings = {**ctx.generation_settings(max_new_tokens), "answer_protocol": protocol, "stop": stop,
                    "shots": 0 if rules.prompt is not None else len(self.exemplars(ctx))}
        if rules.prompt is not None:
            settings.update(prompt_style=rules.name, chat_template=None)
        results = ctx.result_file(self.name, settings)
        ids = [ex["id"] for ex in examples]
        todo = [i for i, (ex, p) in enumerate(zip(examples, prompts, strict=True))
                if results.get(ex["id"], prompt=p) is None]

        def store(batch: list[int], outputs: list[str]) -> None:
            for j, text in zip(batch, outputs, strict=True):
                ex = examples[todo[j]]
                results.put({"id": ex["id"], "question": ex["question"], "gold": ex["gold"],
                             "prompt": prompts[todo[j]], "output": text})
            results.save(ids)

        if todo:
            ctx.generate([prompts[i] for i in todo], max_new_tokens, on_batch=store, desc=self.name, stop=stop)
        correct = []
        for ex in examples:
            entry = results.get(ex["id"])
            entry["prediction"] = rules.extract(entry["output"])
            entry["correct"] = rules.equal(entry["prediction"], ex["gold"])
            correct.append(entry["correct"])
        results.metrics = {"accuracy": accuracy(correct)}
        results.save(ids)
        return dict(results.metrics)
