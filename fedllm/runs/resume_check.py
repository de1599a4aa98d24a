"""``--resume`` continues the run that is on disk, not another one: the recipe is compared with the run's.

Keys that change the result (model, LoRA, data, partition, seed, federation, strategy and its
arguments, local training) must equal the run's ``recipe.yaml``; a difference is refused
(exit 2) with every differing key listed. Keys that do not change what a round computes may
change, and the change is recorded in ``metrics.jsonl`` (``{"resumed_after_round": N, "changed": ...}``):
see :data:`SAFE_KEYS` and :data:`SAFE_SECTIONS` (under differential privacy not the update-norm screen's
keys, :data:`PART_OF_DP`).

Not protected: the *contents* of a data file edited in place under the same path (the path is
compared, not the bytes), and values the run's ``recipe.yaml`` holds redacted (URL credentials).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fedllm.common.errors import InputError
from fedllm.recipe.schema import Recipe, read_written_yaml

SAFE_SECTIONS = ("eval", "logging", "checkpoint")
"""Sections that may change on ``--resume`` (what is measured, logged and checkpointed; not what is trained)."""

SAFE_KEYS = frozenset({
    "federation.rounds",  # the run is extended or shortened (the lr schedule follows the new total)
    "train.threads", "data.cache", "data.cache_dir",  # where and how fast, not what
    "train.gradient_checkpointing",  # memory for compute: the same gradients (tests/training/test_gradient_checkpointing.py)
    # fault policy: changes nothing in a round without faults (e.g. resume a run stopped by
    # on_client_error=fail with skip)
    "federation.on_client_error", "federation.min_clients_per_round", "federation.round_retries",
    "federation.max_update_norm", "federation.update_outlier_factor", "federation.round_deadline",
    "federation.communication_budget_mb",  # reported against, never acted on
    "privacy.per_client_stats",  # what metrics.jsonl records of each client, not what is trained
})
"""Single keys that may change on ``--resume``."""

PART_OF_DP = {
    "federation.max_update_norm": "under differential privacy the update-norm screen decides which uploads are "
                                  "summed and which steps are accounted: part of the mechanism",
    "federation.update_outlier_factor": "under differential privacy the update-norm screen decides which uploads "
                                        "are summed and which steps are accounted: part of the mechanism",
    "federation.round_deadline": "under differential privacy the round deadline decides which uploads are summed: "
                                 "part of the mechanism",
}
"""Safe keys that may not change on ``--resume`` of a run under differential privacy (``privacy.mechanism`` not
``none``), with why."""


class ResumeMismatchError(InputError):
    """``--resume`` with a recipe whose result-changing keys differ from the run's (exit 2)."""


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (mappings only; lists are leaves)."""
    if isinstance(value, dict) and (value or not prefix):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def is_safe(key: str, private: bool = False) -> bool:
    """Whether ``key`` may differ from the run's on ``--resume`` (``private``: a run under differential privacy)."""
    if private and key in PART_OF_DP:
        return False
    return key in SAFE_KEYS or key.split(".", 1)[0] in SAFE_SECTIONS


#: Keys whose ``auto`` the run resolves for its device before it loads the model (``fedllm.models.hardware``): a
#: recipe's ``auto`` is compared with the run's value once resolved (``fedllm.engine.server`` checks again then).
RESOLVED_AT_START = ("train.dtype", "model.dtype")


def _same(key: str, old: Any, new: Any) -> bool:
    if old == new or (key in RESOLVED_AT_START and new == "auto"):
        return True
    if isinstance(old, (int, float)) and isinstance(new, (int, float)) and not isinstance(old, bool):
        return float(old) == float(new)
    if key.endswith("path") and isinstance(old, str) and isinstance(new, str) and old and new:
        return Path(old).expanduser().resolve() == Path(new).expanduser().resolve()
    return False


def differences(run_recipe: dict[str, Any], recipe: Recipe) -> dict[str, tuple[Any, Any]]:
    """``key -> (run's value, given value)`` of every key that differs (a key the run's file lacks is
    compared with its default: the run was written by an older fedllm)."""
    old, new = flatten(run_recipe), flatten(recipe.to_dict())
    defaults = flatten(Recipe().to_dict())
    out = {}
    for key in sorted((set(old) | set(new)) - {"output_dir"}):  # a moved run is the same run
        before = old.get(key, defaults.get(key))
        after = new.get(key, defaults.get(key))
        if not _same(key, before, after):
            out[key] = (before, after)
    return out


def check_resume_recipe(run_dir: Path, recipe: Recipe) -> dict[str, list[Any]]:
    """Compare ``recipe`` with ``run_dir/recipe.yaml``; return the safe changes (``key -> [run's, given]``).

    Raises:
        ResumeMismatchError: a result-changing key differs; every such key is listed with both values.
    """
    path = Path(run_dir) / "recipe.yaml"
    if not path.is_file():
        return {}
    try:
        run_recipe = read_written_yaml(path.read_text(encoding="utf-8-sig"))
    except Exception as e:  # noqa: BLE001 — a damaged recipe.yaml: named, exit 2
        raise ResumeMismatchError(f"{path}: unreadable ({type(e).__name__}: {e}); cannot check what --resume "
                                  "would continue") from None
    if not isinstance(run_recipe, dict):
        raise ResumeMismatchError(f"{path}: not a recipe mapping; cannot check what --resume would continue")
    diff = differences(run_recipe, recipe)
    private = recipe.privacy.mechanism != "none"
    refused = {k: v for k, v in diff.items() if not is_safe(k, private)}
    if refused:
        lines = [f"  - {k}: the run has {a!r}, the recipe gives {b!r}"
                 + (f" ({PART_OF_DP[k]})" if private and k in PART_OF_DP else "") for k, (a, b) in refused.items()]
        raise ResumeMismatchError(
            f"{recipe.source}: --resume of {run_dir} refused: {len(refused)} key(s) that change the result differ "
            f"from {path}:\n" + "\n".join(lines) + "\nresume with the run's values, or start a new run "
            "(output_dir=<new dir>, or --overwrite)")
    return {k: list(v) for k, v in diff.items()}

