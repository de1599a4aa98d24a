"""Run the tasks of an eval config on a model in memory (after training, or every N rounds)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from fedllm.common.registry import tasks
from fedllm.evaluation.context import EvalContext, file_suffix
from fedllm.evaluation.judge_client import Complete, JudgeClient
from fedllm.evaluation.results import write_json_atomic
from fedllm.evaluation.task import Task
from fedllm.evaluation.task_names import harness_task
from fedllm.recipe.schema import DataConfig, EvalConfig

log = logging.getLogger(__name__)


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
    preference: Any = None,
    reference_policy: bool = False,
) -> dict[str, float]:
    """Run every task of ``eval_cfg.tasks`` and return flat metrics.

    Args:
        model: a (PEFT or plain) HF model in memory; its train/eval state is restored.
        tokenizer: its tokenizer.
        eval_cfg: the recipe's eval section (tasks, limits, data, judge).
        out_dir: directory of the per-task result files (``<task>[.<tag>].json``), the judge
            cache and ``summary[.<tag>].json`` (the metrics and protocol of every task evaluated into
            it, by this call or earlier ones); existing files are resumed. None: nothing written.
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
        preference: ``train.preference`` of a DPO run, for ``pref_accuracy``'s rewards (None: the defaults).
        reference_policy: ``model`` is the model ``eval_examples``' reference log-probabilities were computed from
            (a run before round 1): ``pref_accuracy`` takes its policy's log-probabilities from them.

    Returns:
        ``{"<task>/<metric>": value}``, e.g. ``{"gsm8k/accuracy": 0.4, "mt_bench/mt1": 6.1}``.
    """
    ctx = EvalContext(model=model, tokenizer=tokenizer, cfg=eval_cfg,
                      out_dir=Path(out_dir) if out_dir is not None else None, tag=tag, records=records,
                      eval_examples=eval_examples, prompt_style_name=prompt_style, judge=judge, progress=progress,
                      preference=preference, reference_policy=reference_policy)
    metrics: dict[str, float] = {}
    protocols: dict[str, Optional[str]] = {}
    for name in eval_cfg.tasks:
        task = make_task(name)
        for key, value in task.run(ctx).items():
            metrics[f"{name}/{key}"] = value
        protocols[name] = task.protocol(ctx)
    if ctx.out_dir is not None:
        merge_summary(ctx.out_dir / f"summary{file_suffix(tag)}.json", metrics, protocols)
    return metrics


def make_task(name: str) -> Task:
    """The task called ``name``: a registered one, or ``lm_eval:<task>`` run by lm-evaluation-harness."""
    if harness_task(name):
        from fedllm.evaluation.harness import HarnessTask

        return HarnessTask(name)
    return tasks.get(name)()


def merge_summary(path: Path, metrics: dict[str, float], protocols: dict[str, Optional[str]]) -> None:
    """Write ``{"metrics": ..., "protocols": ...}`` to ``path``, keeping the tasks of earlier calls.

    The tasks in ``protocols`` replace their earlier metrics; other tasks' entries stay, so two
    ``fedllm eval`` calls into one directory leave both calls' numbers.
    """
    old: dict = {}
    if path.is_file():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            log.warning("%s: unreadable (%s); written afresh", path, e)
    old_metrics = old.get("metrics", {}) if isinstance(old.get("metrics"), dict) else {}
    kept = {k: v for k, v in old_metrics.items() if k.partition("/")[0] not in protocols}
    kept_protocols = {k: v for k, v in old.get("protocols", {}).items() if k not in protocols} \
        if isinstance(old.get("protocols"), dict) else {}
    write_json_atomic(path, {"metrics": {**kept, **metrics}, "protocols": {**kept_protocols, **protocols}})


def prompt_style_for_data(data_cfg: DataConfig, eval_cfg: Optional[EvalConfig] = None) -> Optional[str]:
    """The prompt style a run is evaluated in: ``eval.prompt_style`` when the recipe names one (a protocol that
    prompts otherwise than the run trained: FedLLM-Bench asks its DPO runs, trained on prompts as given, in the
    Alpaca template), else the one matching how its training data was formatted.

    ``alpaca`` for instruction data with the Alpaca template (or OpenFedLLM's spelling of it, ``openfedllm``, whose
    text the judged tasks' reference prompts use), ``chat`` for chat data, None (the default rule) otherwise. A chat run trained with a FastChat template is prompted in
    that template (:func:`eval_config_for_data`).
    """
    if eval_cfg is not None and eval_cfg.prompt_style:
        return eval_cfg.prompt_style
    if data_cfg.format == "instruction" and data_cfg.template in ("alpaca", "openfedllm"):
        return "alpaca"
    if data_cfg.format == "chat":
        return "chat"
    return None


def eval_config_for_data(eval_cfg: EvalConfig, data_cfg: DataConfig) -> EvalConfig:
    """``eval_cfg`` with ``chat_template`` set to the FastChat conversation template a chat run was trained with
    (``data.template``) when the recipe names none, so that its generations -- both MT-Bench turns included --
    are prompted in the conversation format it learnt, as FastChat's ``gen_model_answer.py`` prompts a model
    in its own template (``get_conversation_template``). Other runs' configs are returned as they are."""
    if eval_cfg.chat_template is None and data_cfg.format == "chat" and data_cfg.template not in (None, "tokenizer"):
        return dataclasses.replace(eval_cfg, chat_template=data_cfg.template)
    return eval_cfg


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
