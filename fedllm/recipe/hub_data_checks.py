"""Hub data sets a recipe reads that cannot load from here (offline and not in the local cache).

``eval.tasks: [advbench]`` without ``eval.data.advbench`` reads AdvBench from the hub; offline, that used to
fail when the first evaluation ran, after the model had loaded and rounds had trained. The recipe checks ask
the caches here instead (no ``datasets`` import, no request), as :mod:`fedllm.models.hub` does for models.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Optional

from fedllm.recipe.schema import Recipe

#: task -> (its default hub data set, whether held-out training records are used first when the recipe has them);
#: the tasks' own ``hub`` attributes (tests/cli/test_early_refusals.py holds the two equal). FlowerTune's tasks
#: read several sets each and are left to their own messages.
TASK_HUB_DATA: dict[str, tuple[str, bool]] = {
    "20ng": ("SetFit/20_newsgroups", True),
    "advbench": ("walledai/AdvBench", False),
    "cola": ("nyu-mll/glue", True),
    "gsm8k": ("openai/gsm8k", True),
    "math": ("EleutherAI/hendrycks_math", False),
    "math500": ("HuggingFaceH4/MATH-500", False),
    "qnli": ("nyu-mll/glue", True),
    "rte": ("nyu-mll/glue", True),
}

#: tasks whose ``eval.answer_protocol: lm_eval`` has lm-evaluation-harness read its own copy of the data
HARNESS_READS_ITS_OWN = ("gsm8k", "math", "math500")


def _snake(name: str) -> str:
    """``AdvBench`` -> ``adv_bench``: how ``datasets`` names a data set's cache directory."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z\d])([A-Z])", r"\1_\2", name).lower()


def dataset_cached(repo_id: str) -> bool:
    """Whether hub data set ``repo_id`` has a copy in the Hugging Face hub cache or in ``datasets``' cache."""
    from huggingface_hub import constants

    if (Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}").is_dir():
        return True
    cache = Path(os.environ.get("HF_DATASETS_CACHE") or Path(constants.HF_HOME) / "datasets").expanduser()
    namespace, _, name = repo_id.rpartition("/")
    return any((cache / (f"{namespace}___{n}" if namespace else n)).is_dir() for n in {name, _snake(name)})


def dataset_unavailable(repo_id: str) -> Optional[str]:
    """Why hub data set ``repo_id`` cannot load from here, or None when it may."""
    from fedllm.models import hub

    if dataset_cached(repo_id):
        return None
    if hub.offline():
        return "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    if not hub.reachable():
        return "not in the local Hugging Face cache and the hub cannot be reached from this machine"
    return None


def _hub_id(spec: Optional[str]) -> Optional[str]:
    """The hub data set a data spec names (``owner/name[:config][@split]``), or None for a local path."""
    from fedllm.data.loading import looks_local

    if not spec or looks_local(spec) or Path(spec).expanduser().exists():
        return None
    return spec.partition("@")[0].partition(":")[0]


def hub_data_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` for each hub data set the recipe reads that cannot load from here."""
    held_out = bool(r.data.eval_fraction > 0 or r.data.eval_path or r.data.eval_split)
    asked: list[tuple[str, Any, str]] = []  # (key, given, hub id)
    for key, spec in (("data.path", r.data.path), ("data.eval_path", r.data.eval_path),
                      *((f"eval.data.{task}", spec) for task, spec in r.eval.data.items())):
        repo = _hub_id(spec)
        if repo:
            asked.append((key, spec, repo))
    for task in r.eval.tasks:
        if task not in TASK_HUB_DATA or r.eval.data.get(task):
            continue
        repo, reads_held_out = TASK_HUB_DATA[task]
        if (reads_held_out and held_out) or (r.eval.answer_protocol == "lm_eval" and task in HARNESS_READS_ITS_OWN):
            continue
        asked.append((f"eval.data.{task}", None, repo))
    problems = []
    for key, given, repo in asked:
        why = dataset_unavailable(repo)
        if why:
            local = " (a local file of the data)" if given is None else ""
            expected = (f"data that loads from here{local}: the hub data set {repo!r} is {why}; give a local file or "
                        f"directory instead ({key}=PATH)")
            problems.append((key, given, expected))
    return problems
