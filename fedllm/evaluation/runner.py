"""Run the tasks of an eval config on a model in memory (after training, or every N rounds)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence, Union

from fedllm.config import DataConfig, EvalConfig
from fedllm.evaluation.context import EvalContext, file_suffix
from fedllm.evaluation.judge_client import Complete, JudgeClient
from fedllm.evaluation.results import write_json_atomic
from fedllm.registry import tasks


def evaluate(
    model,
    tokenizer,
    eval_cfg: EvalConfig,
    out_dir: Optional[Path],
    records: Optional[list[dict]] = None,
    eval_examples: Optional[Sequence[dict]] = None,
    tag: str = "",
    *,
    prompt_style: Optional[str] = None,
    judge: Union[JudgeClient, Complete, None] = None,
    progress: bool = True,
) -> dict[str, float]:
    """Run every task of ``eval_cfg.tasks`` and return flat metrics.

    Args:
        model: a (PEFT or plain) HF model in memory; its train/eval state is restored.
        tokenizer: its tokenizer.
        eval_cfg: the recipe's eval section (tasks, limits, data, judge).
        out_dir: directory of the per-task result files (``<task>[.<tag>].json``), the judge
            cache and ``summary[.<tag>].json``; existing files are resumed. None: nothing written.
        records: held-out raw training records (gsm8k without a data file; ref_gpt4).
        eval_examples: held-out tokenized classification examples (``input_ids``, ``label``).
        tag: suffix of the file names (e.g. ``client-3`` for a personal model); metric keys
            stay unprefixed.
        prompt_style: ``alpaca``, ``chat`` or ``plain`` (see :mod:`~fedllm.evaluation.prompt_styles`);
            None: ``chat`` when a chat template is available, else ``plain``. Use
            :func:`prompt_style_for_data` for a training run.
        judge: the judge (a :class:`JudgeClient`, or a ``messages -> reply`` function, wrapped
            with the on-disk cache); None: built from ``eval_cfg.judge`` when a judged task runs.
        progress: show progress bars.

    Returns:
        ``{"<task>/<metric>": value}``, e.g. ``{"gsm8k/accuracy": 0.4, "mt_bench/mt1": 6.1}``.
    """
    ctx = EvalContext(model=model, tokenizer=tokenizer, cfg=eval_cfg,
                      out_dir=Path(out_dir) if out_dir is not None else None, tag=tag, records=records,
                      eval_examples=eval_examples, prompt_style_name=prompt_style, judge=judge, progress=progress)
    metrics: dict[str, float] = {}
    for name in eval_cfg.tasks:
        task = tasks.get(name)()
        for key, value in task.run(ctx).items():
            metrics[f"{name}/{key}"] = value
    if ctx.out_dir is not None:
        write_json_atomic(ctx.out_dir / f"summary{file_suffix(tag)}.json", metrics)
    return metrics


def prompt_style_for_data(data_cfg: DataConfig) -> Optional[str]:
    """The prompt style matching how a run's training data was formatted.

    ``alpaca`` for instruction data with the Alpaca template, ``chat`` for chat data,
    None (the default rule) otherwise. A chat run trained with a FastChat template
    should also set ``eval.chat_template`` to that template.
    """
    if data_cfg.format == "instruction" and data_cfg.template == "alpaca":
        return "alpaca"
    if data_cfg.format == "chat":
        return "chat"
    return None


def eval_due(eval_cfg: EvalConfig, rnd: int, rounds: int) -> bool:
    """Whether the training loop evaluates after round ``rnd`` (0: before training) of ``rounds``.

    Evaluates after the last round, every ``eval.every`` rounds, and at round 0 when
    ``eval.before_training`` is set; never when no task is configured.
    """
    if not eval_cfg.tasks:
        return False
    if rnd == 0:
        return eval_cfg.before_training
    return rnd == rounds or (eval_cfg.every > 0 and rnd % eval_cfg.every == 0)
