"""FlowerTune LLM leaderboard, Code challenge: MBPP, HumanEval, MultiPL-E JavaScript and C++ pass@1 and their average.

FlowerTune scores it with the bigcode-evaluation-harness (:mod:`~fedllm.evaluation.flowertune_code_prompts`):
4 samples per problem at temperature 0.2 (:func:`~fedllm.evaluation.flowertune_generation.code_samples`),
each program executed against the problem's tests; pass@1 = mean over problems of passed/4 (Chen et al. 2021,
Eq. 1). Model-written code runs only with ``eval.allow_code_execution`` (``--allow-code-execution``), each program
in :class:`~fedllm.evaluation.code_sandbox.CodeSandbox` (no network, a read-only file system but a private scratch
tmpfs, its own ``/proc``, no secrets, an unprivileged uid, time/memory/process limits; docs/code_sandbox.md) and
judged as the harness judges it. FlowerTune's command loads the model unquantized (fp32).
"""

from __future__ import annotations

from typing import Any

from fedllm.common.errors import InputError
from fedllm.common.registry import register_task
from fedllm.data.errors import DataError
from fedllm.evaluation import flowertune_generation as gen
from fedllm.evaluation.code_sandbox import VERDICT_RULES, CodeSandbox, SandboxUnavailable, tool_missing
from fedllm.evaluation.context import EvalContext
from fedllm.evaluation.flowertune_code_prompts import CODE_SETS, CodeSet, checked_program, program_of
from fedllm.evaluation.flowertune_data import data_key, read_hub_set
from fedllm.evaluation.flowertune_quantization import quantization_settings
from fedllm.evaluation.flowertune_scoring import mean_pass_at_k
from fedllm.evaluation.sources import DataSourceError, read_records
from fedllm.evaluation.task import Task

CODE_EXECUTION_REFUSED = (
    "flowertune_code scores model-written programs by running them: pass --allow-code-execution "
    "(eval.allow_code_execution: true) to allow it; each program then runs in a sandbox with no network, "
    "a read-only file system but a private scratch directory, time, memory and process limits "
    "(docs/code_sandbox.md)")


def code_rows(ctx: EvalContext, task: str, cs: CodeSet) -> list[dict]:
    """The problems of ``cs``: ``eval.data.<task>.<key>``, else the hub data set the harness loads.

    Raises:
        DataSourceError: neither is available (the message names the task, hub id and key).
    """
    key = data_key(task, cs.key)
    spec = ctx.data_spec(key)
    try:
        rows = read_records(spec, cs.hub.split) if spec else read_hub_set(cs.hub, cs.revision)
    except DataError as e:
        source = f"--data {key}={spec}" if spec else f"the hub data set {cs.hub.spec()}"
        raise DataSourceError(f"{task}: {cs.key} could not be read from {source} ({e}); give a local copy of "
                              f"{cs.hub.spec()} with eval.data.{key} (--data {key}=PATH)") from e
    if cs.expected_rows and not spec and len(rows) != cs.expected_rows:
        raise DataSourceError(f"{task}: {cs.hub.spec()} has {len(rows)} rows, the harness evaluates "
                              f"{cs.expected_rows} (an old cached copy?)")
    return ctx.limited(rows)


@register_task("flowertune_code")
class FlowerTuneCode(Task):
    """FlowerTune Code: pass@1 of MBPP, HumanEval, MultiPL-E JS and C++ and their average."""

    name = "flowertune_code"
    sets = CODE_SETS

    def protocol(self, ctx: EvalContext) -> str:
        return "flowertune"

    def sandbox(self, ctx: EvalContext) -> CodeSandbox:
        """The sandbox programs run in; refused without ``eval.allow_code_execution`` or without isolation."""
        if not ctx.cfg.allow_code_execution:
            raise InputError(CODE_EXECUTION_REFUSED)
        missing = [m for cs in self.sets if (m := tool_missing(cs.language))]
        if missing:
            raise InputError(f"flowertune_code: {'; '.join(missing)} (install them, e.g. apt-get install nodejs g++)")
        try:
            return CodeSandbox()
        except SandboxUnavailable as e:
            raise InputError(f"flowertune_code: model-written code is not run on this machine: {e}") from e

    def run(self, ctx: EvalContext) -> dict[str, float]:
        sandbox = self.sandbox(ctx)
        eos = ctx.tokenizer.eos_token
        settings = {"model": ctx.fingerprint, "protocol": "flowertune", **quantization_settings(ctx.model),
                    "samples": gen.CODE_SAMPLES, "eos": eos, "python": sandbox.python}
        results = ctx.result_file(self.name, settings)
        metrics: dict[str, float] = {}
        order: list[str] = []
        for cs in self.sets:
            rows = code_rows(ctx, self.name, cs)
            ids = [f"{cs.key}/{i}" for i in range(len(rows))]
            prompts = [cs.prompt(r) for r in rows]
            stops = [cs.stop(r) + ([eos] if eos else []) for r in rows]
            order += ids
            if any(results.get(i, prompt=p) is None for i, p in zip(ids, prompts, strict=True)):
                self._generate(ctx, cs, results, ids, prompts, stops, order)
            verdicts = [self._score(sandbox, cs, results.get(i), r, order, results)
                        for i, r in zip(ids, rows, strict=True)]
            metrics[cs.key] = mean_pass_at_k(verdicts, 1)
        metrics["average"] = sum(metrics[cs.key] for cs in self.sets) / len(self.sets)
        results.metrics = metrics
        results.save(order)
        return dict(metrics)

    @staticmethod
    def _generate(ctx: EvalContext, cs: CodeSet, results: Any, ids: list[str], prompts: list[str],
                  stops: list[list[str]], order: list[str]) -> None:
        """All problems of a data set from one seeded stream (as the harness), each stored when generated."""
        def store(i: int, texts: list[str]) -> None:
            results.put({"id": ids[i], "set": cs.key, "prompt": prompts[i],
                         "solutions": [program_of(prompts[i], t, stops[i]) for t in texts]})
            results.save(order)

        # one stop list per call: MultiPL-E's are the same for every problem of a language
        gen.code_samples(ctx.model, ctx.tokenizer, prompts, stops[0] if stops else [], cs.max_length,
                         on_problem=store)

    @staticmethod
    def _score(sandbox: CodeSandbox, cs: CodeSet, entry: dict, row: dict, order: list[str], results: Any) -> list[bool]:
        if "passed" not in entry or entry.get("verdict_rules") != VERDICT_RULES:  # identical programs run once
            programs = [checked_program(s, cs.test(row)) for s in entry["solutions"]]  # (as MultiPL-E caches them)
            outcomes = {p: sandbox.run(cs.language, p) for p in dict.fromkeys(programs)}
            entry["passed"] = [outcomes[p].passed for p in programs]
            entry["status"] = [outcomes[p].status for p in programs]
            entry["verdict_rules"] = VERDICT_RULES
            results.save(order)
        return entry["passed"]
