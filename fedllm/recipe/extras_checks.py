"""Recipe features that need one of fedllm's optional extras (setup.cfg ``[options.extras_require]``).

A feature whose package is missing used to fail when it was first used: minutes in, after the model had loaded
and the run directory was written (``ModuleNotFoundError: No module named 'dp_accounting'``). The recipe checks
ask here instead, before anything is loaded or written, and the problem names the key, the extra and the line
that installs it. Whether a package is installed is asked of the import system's finders, which import nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from fedllm.recipe.schema import Recipe

#: (extra, top-level module, what it provides, the recipe's ``(key, value)`` pairs that ask for it)
Need = tuple[str, str, str, Callable[[Recipe], list[tuple[str, Any]]]]


def _central_dp_keys(r: Recipe) -> list[tuple[str, Any]]:
    return [("privacy.mechanism", r.privacy.mechanism)] if r.privacy.mechanism.startswith("central") else []


def _dp_sgd_keys(r: Recipe) -> list[tuple[str, Any]]:
    return [("privacy.mechanism", r.privacy.mechanism)] if r.privacy.mechanism == "dp_sgd" else []


def _quantisation_keys(r: Recipe) -> list[tuple[str, Any]]:
    keys = [("model.quantization", r.model.quantization), ("eval.quantization", r.eval.quantization),
            ("federation.compression.upload", r.federation.compression.upload),
            ("federation.compression.download", r.federation.compression.download)]
    return [(key, value) for key, value in keys if value != "none"]


def _harness_keys(r: Recipe) -> list[tuple[str, Any]]:
    from fedllm.evaluation.task_names import harness_task

    keys = [("eval.answer_protocol", "lm_eval")] if r.eval.answer_protocol == "lm_eval" and r.eval.tasks else []
    return keys + [("eval.tasks", task) for task in r.eval.tasks if harness_task(task)]


def _fastchat_keys(r: Recipe) -> list[tuple[str, Any]]:
    from fedllm.data.templates import INSTRUCTION_TEMPLATES

    keys = []
    if r.data.format in ("chat", "preference") and r.data.template not in ("tokenizer", "plain", None) \
            and r.data.template not in INSTRUCTION_TEMPLATES:
        keys.append(("data.template", r.data.template))
    if r.eval.chat_template and r.eval.tasks:
        keys.append(("eval.chat_template", r.eval.chat_template))
    return keys


def _tracker_keys(module: str, tracker: str) -> Callable[[Recipe], list[tuple[str, Any]]]:
    def keys(r: Recipe) -> list[tuple[str, Any]]:
        return [(f"logging.report_to[{i}]", name) for i, name in enumerate(r.logging.report_to) if name == tracker]

    keys.__name__ = f"_{tracker}_keys"
    return keys


NEEDS: tuple[Need, ...] = (
    ("privacy", "dp_accounting", "client-level DP's accounting (dp-accounting)", _central_dp_keys),
    ("privacy", "opacus", "DP-SGD and its accounting (opacus)", _dp_sgd_keys),
    ("quant", "bitsandbytes", "quantisation (bitsandbytes)", _quantisation_keys),
    ("eval", "lm_eval", "lm-evaluation-harness", _harness_keys),
    ("fastchat", "fastchat", "FastChat's conversation templates (fschat)", _fastchat_keys),
    ("tracking", "tensorboard", "TensorBoard", _tracker_keys("tensorboard", "tensorboard")),
    ("tracking", "wandb", "Weights & Biases", _tracker_keys("wandb", "wandb")),
    ("tracking", "mlflow", "MLflow", _tracker_keys("mlflow", "mlflow")),
    ("tracking", "trackio", "trackio", _tracker_keys("trackio", "trackio")),
)
"""Every recipe feature that needs an optional package: the extra that installs it, the module, what it is."""


def installed(module: str) -> bool:
    """Whether top-level ``module`` can be imported, asked of ``sys.meta_path``'s finders (nothing is imported).

    A module fedllm itself blocks for a while (``sys.modules[name] = None``, bitsandbytes until a recipe
    quantises) still counts as installed: the finders are asked, not ``sys.modules``.
    """
    if sys.modules.get(module) is not None:
        return True
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            if find(module, None) is not None:
                return True
        except ImportError:  # a finder that refuses the name: not importable
            return False
    return False


def install_line(extra: str) -> str:
    """The command that adds fedllm's ``extra``, run in fedllm's clone (fedllm is not on PyPI)."""
    return f'pip install -e ".[{extra}]"'


def extras_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` for each recipe key whose feature needs a package that is not installed."""
    problems = []
    for extra, module, what, keys in NEEDS:
        asked = keys(r)
        if asked and not installed(module):
            expected = (f"fedllm's [{extra}] extra, for {what}: the {module!r} module is not installed; in "
                        f"fedllm's clone run {install_line(extra)}")
            problems += [(key, given, expected) for key, given in asked]
    return problems
