"""Recipe checks that need more than the schema: data files, the model's config, task names, strategies, privacy.

:func:`load_recipe` and :func:`parse_recipe` are the validated way in: the schema's types and values
(:mod:`fedllm.recipe.schema`), then the checks below, every problem raised at once in one
:class:`~fedllm.recipe.schema.RecipeError`. The modules they ask are imported inside the functions, so that
loading a recipe imports no torch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from fedllm.common.errors import did_you_mean, path_hint
from fedllm.recipe.schema import (
    FINITE,
    Recipe,
    RecipeError,
    build_recipe,
    read_yaml,
    value_problems,
    yaml_problem,
    yaml_where,
)


def missing_files(r: Recipe) -> list[tuple[str, Any, str]]:
    """Local data files the recipe names that do not exist or hold nothing (hub ids are checked when loaded)."""
    from fedllm.data.loading import looks_local
    from fedllm.evaluation.task_names import what_data

    named = [("data.path", r.data.path), ("data.eval_path", r.data.eval_path),
             ("federation.partition.path", r.federation.partition.path)]
    named += [(f"eval.data.{task}", path) for task, path in r.eval.data.items()]
    problems = []
    for key, path in named:
        if not path or not looks_local(path):
            continue
        local = Path(path).expanduser()
        if not local.exists():
            where = "" if local.is_absolute() else (f"; looked for {Path.cwd() / local} (relative to the working "
                                                    f"directory {Path.cwd()})")
            what = what_data(key[len("eval.data."):]) if key.startswith("eval.data.") else ""
            problems.append((key, path, f"an existing local file or directory (or a hub id){where}"
                                        + (f"; for this task: {what}" if what else "") + path_hint(path)))
        elif key != "federation.partition.path" and _holds_nothing(local, r.data.split if key == "data.path" else None):
            problems.append((key, path, "a data file with at least one record (it is empty)"))
    return problems


def _holds_nothing(path: Path, split: Optional[str]) -> bool:
    """Whether a local data file (or a directory's ``<split>.*`` file) is empty or only whitespace / ``[]``."""
    if path.is_dir():
        found = [p for p in sorted(path.glob(f"{split or 'train'}.*")) if p.is_file()]
        if not found:
            return False
        path = found[0]
    if path.suffix.lower() == ".parquet" or not path.is_file():
        return False
    with open(path, "rb") as f:
        head = f.read(1 << 16)
        while head and not head.strip() and len(head) == 1 << 16:
            head = f.read(1 << 16)
    return head.strip() in (b"", b"[]")


def data_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """The recipe's keys against a sample of a local ``data.path`` (columns, class names); [] when it is no local
    .json/.jsonl file (a hub id, a manifest, or a file the loader will name the problem of)."""
    from fedllm.data.loading import local_sample, looks_local
    from fedllm.data.validation import column_problems

    if not r.data.path or not looks_local(r.data.path) or r.federation.partition.path:
        return []
    sample = local_sample(r.data.path, r.data.split)
    return column_problems(r.data, r.federation.partition, sample or [], f"data.path={r.data.path!r}")


def _semantic_problems(r: Recipe, check_files: bool = False, ask_strategy: bool = True) -> list[tuple[str, Any, str]]:
    p: list[tuple[str, Any, str]] = missing_files(r) if check_files else []
    if check_files:  # the model's name and the LoRA rank against its layers, from its config (no weights, no torch)
        from fedllm.data.federated import split_problems
        from fedllm.evaluation.task_names import missing_fastchat_files
        from fedllm.models.info import model_problems

        p.extend(model_problems(r))
        if not any(key == "data.path" for key, _, _ in p):  # more clients than a local file's records
            p.extend(split_problems(r.data, r.federation.partition, r.federation.num_clients))
            p.extend(data_problems(r))
        p.extend(missing_fastchat_files(r.eval))
        from fedllm.recipe.hub_data_checks import hub_data_problems

        p.extend(hub_data_problems(r))  # a hub data set that cannot load from here (offline, not cached)
    p.extend(value_problems(r))
    fed, tr = r.federation, r.train
    from fedllm.common.tracking import TRACKERS

    for i, name in enumerate(r.logging.report_to):
        if name not in TRACKERS:
            p.append((f"logging.report_to[{i}]", name, f"one of {', '.join(TRACKERS)}{did_you_mean(name, TRACKERS)}"))
    from fedllm.common.registry import partitioners, strategies, tasks
    from fedllm.evaluation.task_names import known_task, task_data_problems

    for t in r.eval.tasks:
        if not known_task(t):
            p.append(("eval.tasks", t, f"one of {', '.join(tasks.names())} or lm_eval:<harness task>"
                      f"{did_you_mean(t, tasks.names())}"))
    p.extend(task_data_problems(r.eval, r.data))

    if fed.partition.method not in partitioners:
        p.append(("federation.partition.method", fed.partition.method, f"one of {', '.join(partitioners.names())}"
                  f"{did_you_mean(fed.partition.method, partitioners.names())}"))
    if fed.strategy not in strategies:
        p.append(("federation.strategy", fed.strategy, f"one of {', '.join(strategies.names())}"
                  f"{did_you_mean(fed.strategy, strategies.names())}"))
    elif ask_strategy and (not p or "torch" in sys.modules):
        # the strategy class checks its own arguments; importing it loads torch, which a recipe
        # with other problems should not wait for (they are reported first, at once)
        p.extend(_strategy_arg_problems(r))
    if tr.clients_per_pass > 1:
        p.extend(_client_batching_problems(r, with_strategy=ask_strategy and (not p or "torch" in sys.modules)))
    from fedllm.privacy.recipe_checks import privacy_problems
    from fedllm.recipe.async_checks import async_problems
    from fedllm.recipe.checkpointing_checks import checkpointing_problems
    from fedllm.recipe.compile_checks import compile_problems
    from fedllm.recipe.compression_checks import compression_problems, dora_problems
    from fedllm.recipe.extras_checks import extras_problems
    from fedllm.recipe.packing_checks import packing_problems
    from fedllm.recipe.preference_checks import preference_problems

    p.extend(privacy_problems(r))
    p.extend(async_problems(r))
    p.extend(x for x in preference_problems(r) if x not in p)
    p.extend(compression_problems(r) + dora_problems(r) + packing_problems(r) + compile_problems(r))
    p.extend(checkpointing_problems(r))
    p.extend(extras_problems(r))  # an optional package a feature needs: before anything loads or is written
    return p


def _strategy_arg_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """What the strategy class says about ``federation.strategy_args`` and, under secure aggregation, whether it can
    aggregate from the sum of the uploads (importing it loads torch)."""
    from fedllm.common.registry import strategies
    from fedllm.recipe.async_checks import strategy_async_problems

    cls = strategies.get(r.federation.strategy)
    p = [(f"federation.strategy_args.{key}", given, expected)
         for key, given, expected in cls.check_args(r.federation.strategy_args)]
    if r.federation.round_deadline is not None and cls.late_update_problem:
        p.append(("federation.round_deadline", r.federation.round_deadline, (
            f"null with federation.strategy {r.federation.strategy!r}: it {cls.late_update_problem}")))
    p.extend(strategy_async_problems(r, cls))
    if r.privacy.secure_aggregation == "secagg_plus":
        why = cls.sum_aggregation_problem()
        if why:
            p.append(("privacy.secure_aggregation", "secagg_plus", (f"none with federation.strategy "
                      f"{r.federation.strategy!r}: it {why}, and secure aggregation gives the server only the sum "
                      "of the uploads")))
    return p


def check_strategy(recipe: Recipe) -> None:
    """The checks a ``parse_recipe(..., ask_strategy=False)`` left out: the strategy's own (loads torch).

    Raises:
        RecipeError: the strategy rejects its arguments or client batching.
    """
    problems = _strategy_arg_problems(recipe)
    if recipe.train.clients_per_pass > 1:
        problems += [x for x in _client_batching_problems(recipe) if x not in _client_batching_problems(
            recipe, with_strategy=False)]
    if problems:
        raise RecipeError(recipe.source, from_command_line(problems, getattr(recipe, "overrides", None)))


def _client_batching_problems(r: Recipe, with_strategy: bool = True) -> list[tuple[str, Any, str]]:
    """What stops ``train.clients_per_pass > 1`` (the strategy, per-client moments, fp16, extra trained modules);
    ``with_strategy``: also ask the strategy class (importing it loads torch)."""
    from fedllm.common.registry import strategies

    given = r.train.clients_per_pass
    p = []
    if with_strategy and r.federation.strategy in strategies:
        why = strategies.get(r.federation.strategy).client_batching_problem()
        if why:
            p.append(("train.clients_per_pass", given, f"1 ({why})"))
    if r.train.optimizer_state != "reset":
        p.append(("train.clients_per_pass", given, "1 with train.optimizer_state: per_client (moments restart each round when batched)"))
    if r.train.dtype == "fp16":
        p.append(("train.clients_per_pass", given, "1 with train.dtype: fp16 (one skipped step would skip every client; use bf16)"))
    if r.lora.modules_to_save:
        p.append(("train.clients_per_pass", given, "1 with lora.modules_to_save (only LoRA factors are batched)"))
    return p


def parse_recipe(raw: Any, source: str = "<recipe>", overrides: Optional[list[str]] = None,
                 check_files: bool = False, ask_strategy: bool = True) -> Recipe:
    """Build and validate a :class:`Recipe` from a raw mapping; raise :class:`RecipeError`.

    ``check_files``: also report local data files that do not exist or are empty, a model that cannot load
    from here and a LoRA rank above a layer's size (the CLI does, before loading torch).
    ``ask_strategy=False``: leave out the strategy's own checks, which import torch; the caller runs
    :func:`check_strategy` after its other torch-free checks.
    """
    problems: list = []
    recipe = build_recipe(raw, source, overrides, problems)
    if all(expected == FINITE for _, _, expected in problems):  # the types are right: check the values
        reported = {key for key, _, _ in problems}
        problems.extend(x for x in _semantic_problems(recipe, check_files, ask_strategy) if x[0] not in reported)
    if problems:
        raise RecipeError(source, from_command_line(problems, overrides))
    recipe.source = source
    recipe.overrides = list(overrides or [])
    return recipe


def from_command_line(problems: list[tuple[str, Any, str]], overrides: Optional[list[str]]) -> list[tuple[str, Any, str]]:
    """``problems`` with each one whose key (or a section above it) a dotted override set marked as given on the
    command line (``federation.rounds=0``), so that it is not looked for in the recipe file."""
    given: dict[str, str] = {}
    for item in overrides or []:
        key = item.split("=", 1)[0].strip()
        given[key] = item
    marked = []
    for key, value, expected in problems:
        key_str = str(key)
        origin = next((item for k, item in given.items()
                       if key_str == k or key_str.startswith((k + ".", k + "["))), None)
        if origin is not None and "=" not in origin:  # `federation.rounds 2`: the problem says how to write it
            origin = None
        if origin is not None:
            expected = f"{expected} [set on the command line: {origin}, not in the recipe file]"
        elif key_str.startswith("federation.strategy_args.") and "federation.strategy" in given:
            expected = (f"{expected} [the recipe file's argument; the strategy was changed on the command line: "
                        f"{given['federation.strategy']}]")
        marked.append((key, value, expected))
    return marked


def load_recipe(path: str | Path, overrides: Optional[list[str]] = None, check_files: bool = False,
                ask_strategy: bool = True) -> Recipe:
    """Load ``path`` (UTF-8 YAML, a byte-order mark allowed; ``~`` expanded), apply dotted ``overrides`` and
    validate (see :func:`parse_recipe`)."""
    given, path = str(path), Path(path).expanduser()
    if not path.is_file():
        raise RecipeError(str(path), [("<file>", str(path), f"an existing recipe YAML file{path_hint(given)}")])
    return recipe_from_bytes(path.read_bytes(), str(path), overrides, check_files, ask_strategy)


def recipe_from_bytes(data: bytes, source: str, overrides: Optional[list[str]] = None, check_files: bool = False,
                      ask_strategy: bool = True) -> Recipe:
    """A recipe from the bytes of its YAML file (named ``source`` in messages), as :func:`load_recipe` reads it."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise RecipeError(source, [("<file>", f"byte 0x{data[e.start]:02x} on line {line}", "UTF-8 text")]) from None
    try:
        raw = read_yaml(text)
    except yaml.YAMLError as e:
        raise RecipeError(source, [(yaml_where(e), yaml_problem(e), "valid YAML")]) from None
    return parse_recipe(raw, source, overrides, check_files, ask_strategy)
