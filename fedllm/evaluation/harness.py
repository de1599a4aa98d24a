"""lm-evaluation-harness as a back-end: ``lm_eval:<task>`` tasks and the ``lm_eval`` answer protocol.

The harness (fedllm's ``eval`` extra: ``lm-eval``) runs its own task definitions -- prompts,
few-shot sampling, decoding, filters and metrics -- on the model in memory (base + adapter, or
merged), through :func:`lm_eval.simple_evaluate` with an ``HFLM`` wrapped around it; fedllm
re-implements none of it. Data:

- the task's own ``dataset_path`` (the hub, or the local datasets cache when offline);
- ``eval.data.<name>`` (``<name>`` is ``lm_eval:<task>``, or ``gsm8k``/``math``/``math500``
  under the ``lm_eval`` protocol): a local ``.json``/``.jsonl``/``.csv``/``.parquet`` file (the
  test split), a directory of ``<split>.<ext>`` files (``test.jsonl``, ``train.jsonl``, ...), or a
  hub id ``owner/name[:config]``. Without a file for the task's few-shot split, exemplars are
  drawn from the test file, never the question itself (the harness excludes it). ``math`` hands
  its records to the harness as one file and runs the ``hendrycks_math`` group's shared subject
  config on it (:meth:`fedllm.evaluation.tasks.math_qa.MATH.run_lm_eval`);
- ``eval.data.lm_eval``: a directory of harness task YAML files (the harness's
  ``--include_path``), for tasks the harness does not ship.

Metric keys are ``<name>/<harness metric>`` with the harness's filter appended after a dot
unless it is ``none`` (``lm_eval:arc_easy/acc``, ``gsm8k/exact_match.flexible-extract``); the
subtasks of a group add ``<subtask>.`` in front. The per-example samples the harness logs are
written to ``<out>/<name>.json``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import re
from pathlib import Path
from typing import Any, Iterator, Optional

from fedllm.common.errors import InputError, install_hint
from fedllm.evaluation.context import EvalContext, file_suffix
from fedllm.evaluation.results import write_json_atomic
from fedllm.evaluation.task import Task
from fedllm.evaluation.task_names import harness_task

INCLUDE_KEY = "lm_eval"
"""``eval.data`` key naming a directory of extra harness task YAML files."""

_LOADERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class HarnessTask(Task):
    """``lm_eval:<task>``: any lm-evaluation-harness task or group, run by the harness."""

    def __init__(self, name: str):
        self.name = name

    def protocol(self, ctx: EvalContext) -> Optional[str]:
        return "lm_eval"

    def run(self, ctx: EvalContext) -> dict[str, float]:
        return run_harness_task(ctx, self.name, harness_task(self.name), data_spec=ctx.data_spec(self.name))


def _import_harness():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise InputError("lm_eval tasks and the lm_eval answer protocol need lm-evaluation-harness: "
                         f"{install_hint('eval')}") from e
    return lm_eval, HFLM, TaskManager


@functools.lru_cache(maxsize=4)
def _task_manager(include: Optional[tuple[str, ...]], defaults: bool):
    """A harness ``TaskManager`` over the ``include`` folders, and the harness's own thousands of YAML files
    when ``defaults`` (indexing them takes a while: built once)."""
    return _import_harness()[2](include_path=list(include) if include else None, include_defaults=defaults)


def task_manager_for(task: str, include: Optional[str], home: Optional[str] = None):
    """The ``TaskManager`` that knows ``task``, indexing as little as it can.

    Args:
        task: the harness's task or group name.
        include: the user's folder of task YAML files (``eval.data.lm_eval``), or None.
        home: the folder of the harness's own tasks that defines ``task`` (``gsm8k`` for
            ``lm_eval/tasks/gsm8k``), when fedllm knows it: the answer protocols' tasks.

    Returns:
        A manager over ``home`` and ``include`` alone (``include`` overrides ``home``, as it overrides
        the defaults in the harness) when they define ``task``, else one over every task of the harness.
    """
    folders = tuple(str(f) for f in (_harness_tasks_dir() / home if home else None, include) if f)
    if folders:
        local = _task_manager(folders, False)
        if task in local.task_index:
            return local
    return _task_manager((include,) if include else None, True)


def _harness_tasks_dir() -> Path:
    """``lm_eval/tasks`` of the installed harness."""
    return Path(_import_harness()[0].__file__).parent / "tasks"


def _data_files(spec: str) -> tuple[str, dict[str, str]]:
    """``(loader, {split: file})`` of a local file or a directory of ``<split>.<ext>`` files."""
    path = Path(spec).expanduser()
    files = sorted(p for p in path.iterdir() if p.suffix in _LOADERS) if path.is_dir() else [path]
    if not files or path.suffix not in _LOADERS and not path.is_dir():
        raise InputError(f"{spec}: expected a {', '.join(_LOADERS)} file or a directory of <split> files")
    loaders = {_LOADERS[p.suffix] for p in files}
    if len(loaders) != 1:
        raise InputError(f"{spec}: files of one format only ({', '.join(p.name for p in files)})")
    if path.is_dir():
        return loaders.pop(), {p.stem: str(p) for p in files}
    return loaders.pop(), {"*": str(path)}


def task_spec(task_manager, task: str, data_spec: Optional[str], config_of: Optional[str] = None) -> Any:
    """The harness task ``task`` as :func:`lm_eval.simple_evaluate` takes it, its data from ``data_spec``.

    Args:
        task_manager: a manager that knows ``task`` (:func:`task_manager_for`).
        task: the harness's task or group name.
        data_spec: local data or hub id replacing the task's dataset, or None.
        config_of: for a group ``task`` whose tasks share one config and differ only in their hub subset
            (``hendrycks_math``: seven subjects of ``EleutherAI/hendrycks_math``), one of those tasks: with
            ``data_spec`` its config, named ``task``, runs once on the whole of the data.

    Raises:
        InputError: the task is unknown to the harness, or is a group (without ``config_of``) or a Python task
            while data are given.
    """
    entry = task_manager.task_index.get(task)
    if entry is None:
        raise InputError(f"lm_eval:{task}: not a task of lm-evaluation-harness (nor of eval.data.{INCLUDE_KEY}); "
                         "`lm_eval ls tasks` lists them")
    if not data_spec:
        return task
    if config_of and task in task_manager.all_groups:
        entry = task_manager.task_index[config_of]
    elif entry.yaml_path is None or task in task_manager.all_groups or task in task_manager.all_tags:
        raise InputError(f"eval.data for {task}: local data replace one task's dataset; {task} is a group or a "
                         "Python task: give data for each of its tasks (lm_eval:<subtask>) or none")
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    if cfg.get("task") != task:
        cfg = {k: v for k, v in cfg.items() if k != "tag"} | {"task": task}
    if Path(data_spec).expanduser().exists():
        loader, files = _data_files(data_spec)
        test = cfg.get("test_split") or cfg.get("validation_split")  # the split the harness evaluates
        if "*" in files:
            files = {test: files["*"]}
        elif test not in files:
            raise InputError(f"{data_spec}: no {test} file for {task}")
        override = {"dataset_path": loader, "dataset_name": None}
        for key in ("training_split", "validation_split"):
            if cfg.get(key) and cfg[key] not in files:
                override[key] = None
        shots_from = cfg.get("fewshot_split") or cfg.get("training_split")
        if shots_from and shots_from not in files:
            override["fewshot_split"] = test  # exemplars from the test file: the harness then skips the question
        return {**cfg, **override, "dataset_kwargs": {"data_files": files}}
    hub, _, config = data_spec.partition("@")[0].partition(":")
    return {**cfg, "dataset_path": hub, "dataset_name": config or None}


def _metric_name(key: str) -> Optional[str]:
    """``"exact_match,strict-match"`` -> ``"exact_match.strict-match"``, ``"acc,none"`` -> ``"acc"``; None for
    stderr entries and keys without a filter (``alias``)."""
    metric, sep, filt = key.partition(",")
    if not sep or metric.endswith("_stderr"):
        return None
    return metric if filt == "none" else f"{metric}.{filt}"


def harness_metrics(results: dict, task: str) -> dict[str, float]:
    """Flat numeric metrics of ``task`` (and of its subtasks, prefixed) from the harness's results."""
    out: dict[str, float] = {}
    table = results.get("results", {})
    for name in [task] + sorted(k for k in table if k != task):
        for key, value in table.get(name, {}).items():
            metric = _metric_name(key)
            if metric is None or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            out[metric if name == task else f"{name}.{metric}"] = float(value)
    return out


@contextlib.contextmanager
def _eval_mode(model) -> Iterator[None]:
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _no_environment_report() -> Iterator[None]:
    """:func:`lm_eval.simple_evaluate` without the environment report it adds to its results (``add_env_info``:
    torch's ``collect_env``, which runs ``pip list`` and ten other programs: ~0.8 CPU-s and a second or more of wall
    per task); fedllm's result file keeps none of it (it records the harness's version itself)."""
    from lm_eval import evaluator

    add_env_info = evaluator.add_env_info
    evaluator.add_env_info = lambda storage: None
    try:
        yield
    finally:
        evaluator.add_env_info = add_env_info


def run_harness_task(ctx: EvalContext, name: str, task: str, data_spec: Optional[str] = None,
                     home: Optional[str] = None, config_of: Optional[str] = None,
                     data_label: Optional[str] = None) -> dict[str, float]:
    """Run the harness task ``task`` on ``ctx.model``; write ``<name>.json``; return its metrics.

    Args:
        ctx: the evaluation context (``eval.limit`` -> the harness's ``limit``, ``eval.batch_size``,
            ``eval.seed`` -> the harness's seeds).
        name: fedllm's name of the task (file name, metric prefix).
        task: the harness's task or group name.
        data_spec: local data or hub id replacing the task's dataset (module docstring).
        home: the harness's own folder defining ``task`` (:func:`task_manager_for`), or None.
        config_of: the task whose config runs a group ``task`` on ``data_spec`` (:func:`task_spec`), or None.
        data_label: what the result file records as the data (default: ``data_spec``).
    """
    lm_eval, HFLM, _ = _import_harness()
    include = ctx.data_spec(INCLUDE_KEY)
    manager = task_manager_for(task, str(Path(include).expanduser().resolve()) if include else None, home)
    spec = task_spec(manager, task, data_spec, config_of)
    # a copy: the harness sets a pad token (or adds one) on the tokenizer it is given
    lm = HFLM(pretrained=ctx.model, tokenizer=copy.deepcopy(ctx.tokenizer), batch_size=ctx.cfg.batch_size)
    seed = ctx.cfg.seed
    with _eval_mode(ctx.model), _no_environment_report():
        results = lm_eval.simple_evaluate(model=lm, tasks=[spec], limit=ctx.cfg.limit, task_manager=manager,
                                          log_samples=True, bootstrap_iters=0, random_seed=seed,
                                          numpy_random_seed=seed, torch_random_seed=seed,
                                          fewshot_random_seed=seed)
    metrics = harness_metrics(results, task)
    if ctx.out_dir is not None:
        samples = {k: [_sample(s) for s in v] for k, v in (results.get("samples") or {}).items()}
        write_json_atomic(Path(ctx.out_dir) / f"{name}{file_suffix(ctx.tag)}.json", _clean({
            "task": name, "settings": {"model": ctx.fingerprint, "answer_protocol": "lm_eval", "harness_task": task,
                                       "lm_eval_version": getattr(lm_eval, "__version__", ""),
                                       "data": data_label or data_spec,
                                       "limit": ctx.cfg.limit, "seed": seed,
                                       "n_shot": results.get("n-shot", {}), "configs": results.get("configs", {})},
            "metrics": metrics, "examples": samples}))
    return metrics


def _sample(sample: dict) -> dict:
    """One logged harness sample, without the harness's hashes."""
    return {k: v for k, v in sample.items() if not k.endswith("_hash")}


def _clean(value: Any) -> Any:
    """``value`` made JSON-safe (other objects as their ``str``, non-finite floats as None)."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    return re.sub(r" at 0x[0-9a-f]+", "", str(value))


def hendrycks_math_reference(solution: Any) -> Optional[str]:
    """The reference answer lm-evaluation-harness's ``hendrycks_math`` tasks take from a solution (its
    ``utils.process_docs``: ``remove_boxed(last_boxed_only_string(solution))``, the harness's own functions), or
    None where they would fail: no solution text, or no ``\\boxed`` at its end."""
    _import_harness()
    from lm_eval.tasks.hendrycks_math.utils import last_boxed_only_string, remove_boxed

    if not isinstance(solution, str):
        return None
    try:
        box = last_boxed_only_string(solution)
        return None if box is None else remove_boxed(box)
    except AssertionError:  # an \fbox: remove_boxed wants \boxed
        return None


def gsm8k_verdicts(output: str, gold_solution: str) -> dict[str, bool]:
    """lm-evaluation-harness's ``gsm8k`` verdicts on one generation, per filter (``strict-match``,
    ``flexible-extract``): the filters and ``exact_match`` settings read from the harness's own
    ``gsm8k.yaml``, applied with its ``RegexFilter`` and ``exact_match`` metric (to re-score outputs
    another protocol generated)."""
    import yaml
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    lm_eval = _import_harness()[0]
    cfg = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())
    metric = cfg["metric_list"][0]
    out = {}
    for flt in cfg["filter_list"]:
        regex = flt["filter"][0]
        picked = RegexFilter(regex_pattern=regex["regex_pattern"], group_select=regex.get("group_select", 0)).apply(
            [[output]], [{}])[0][0]
        score = exact_match_hf_evaluate([picked], [gold_solution], regexes_to_ignore=metric["regexes_to_ignore"],
                                        ignore_case=metric["ignore_case"],
                                        ignore_punctuation=metric["ignore_punctuation"])["exact_match"]
        out[flt["name"]] = bool(score)
    return out
