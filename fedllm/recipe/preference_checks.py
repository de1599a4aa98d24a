"""Recipe checks of preference alignment (``train.objective: dpo``, ``data.format: preference``).

Every strategy trains DPO: a client step is gradient descent on whatever its plan trains, and the loss is the
engine's (:data:`fedllm.engine.client.OBJECTIVES`). What cannot hold is refused here, with the reason:

* ``train.preference.reference: adapter_disabled`` with a strategy whose adapter-disabled model is not the
  policy training started from (it merges into the base or starts from a non-zero adapter);
* ``privacy.grad_sample_mode: ghost`` with ``privacy.mechanism: dp_sgd``: DP-SGD clips each *pair's* gradient
  (the sum of its chosen and rejected rows' per-example gradients: :mod:`fedllm.privacy.dp_sgd`), while ghost
  clipping takes each row's gradient norm without the gradient, and a pair's norm needs the inner product of its
  two rows' gradients;
* ``train.clients_per_pass > 1``: the batched client pass computes the next-token loss only.
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schema import Recipe

#: Strategies that never change the base and start every adapter with a zero product: with them the base with
#: the adapter disabled is the policy training started from (``reference: adapter_disabled``).
ADAPTER_DISABLED_STRATEGIES = frozenset(
    {
        "fedavg",
        "fedprox",
        "scaffold",
        "fedavgm",
        "fedadagrad",
        "fedyogi",
        "fedadam",
        "ffa_lora",
        "fedsvd",
        "fedsa_lora",
        "local",
        "krum",
        "multikrum",
        "bulyan",
        "fedmedian",
        "fedtrimmedavg",
    }
)


def preference_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` of the preference keys (no torch imported)."""
    p: list[tuple[str, Any, str]] = []
    tr, pref = r.train, r.train.preference
    if tr.objective == "dpo" and r.data.format != "preference":
        p.append(
            (
                "train.objective",
                tr.objective,
                f"sft with data.format: {r.data.format} (dpo trains on chosen/rejected pairs: data.format: preference)",
            )
        )
    if r.data.format == "preference" and tr.objective != "dpo":
        p.append(("train.objective", tr.objective, "dpo with data.format: preference (pairs train a pairwise loss)"))
    if "pref_accuracy" in r.eval.tasks and r.data.format != "preference":
        p.append(
            (
                "eval.tasks",
                "pref_accuracy",
                (
                    f"a task for data.format: {r.data.format} (pref_accuracy scores "
                    "held-out preference pairs: data.format: preference)"
                ),
            )
        )
    held_out = r.data.eval_fraction > 0 or r.data.eval_path or r.data.eval_split
    if "pref_accuracy" in r.eval.tasks and r.data.format == "preference" and not held_out:
        p.append(
            (
                "data.eval_fraction",
                r.data.eval_fraction,
                "a fraction > 0 (or data.eval_path) with eval.tasks: pref_accuracy (it scores held-out pairs)",
            )
        )
    if tr.objective != "dpo":
        return p
    if not pref.beta > 0:
        p.append(("train.preference.beta", pref.beta, "a positive number"))
    eps = pref.label_smoothing
    if pref.loss == "robust" and not 0 <= eps < 0.5:
        p.append(("train.preference.label_smoothing", eps, "a number in [0, 0.5) for loss: robust"))
    elif pref.loss == "simpo" and not 0 <= eps <= 0.5:
        p.append(("train.preference.label_smoothing", eps, "a number in [0, 0.5] for loss: simpo"))
    elif pref.loss not in ("robust", "simpo") and eps != 0:
        p.append(
            (
                "train.preference.label_smoothing",
                eps,
                (
                    f"0 for loss: {pref.loss} (label smoothing is robust's "
                    "and simpo's; trl's sigmoid, ipo and hinge ignore it)"
                ),
            )
        )
    if (
        pref.reference == "adapter_disabled"
        and pref.loss != "simpo"
        and r.federation.strategy not in ADAPTER_DISABLED_STRATEGIES
    ):
        p.append(
            (
                "train.preference.reference",
                pref.reference,
                (
                    f"precomputed with federation.strategy: {r.federation.strategy} (it merges into the base or starts "
                    "from a non-zero adapter, so the adapter-disabled model is not the policy training started from; "
                    f"adapter_disabled suits {', '.join(sorted(ADAPTER_DISABLED_STRATEGIES))})"
                ),
            )
        )
    if r.privacy.mechanism == "dp_sgd" and r.privacy.grad_sample_mode == "ghost":
        p.append(
            (
                "privacy.grad_sample_mode",
                "ghost",
                (
                    "hooks with train.objective: dpo (DP-SGD clips each preference pair's gradient, the sum of its "
                    "chosen and rejected sequences' gradients; ghost clipping computes each sequence's gradient "
                    "norm only, and a pair's norm needs the inner product of the two)"
                ),
            )
        )
    if tr.clients_per_pass > 1:
        p.append(
            (
                "train.clients_per_pass",
                tr.clients_per_pass,
                "1 with train.objective: dpo (a batched client pass computes the next-token loss only)",
            )
        )
    return p
