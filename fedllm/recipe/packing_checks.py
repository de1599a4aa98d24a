"""Recipe checks of ``train.packing`` (padding-free micro-batches, :mod:`fedllm.data.packing`).

A packed micro-batch is one row holding its examples end to end, told apart by their position ids. What cannot
hold is refused here, with the reason:

* a sequence classifier (``model.task: classification``, or a BERT/RoBERTa preset): it pools one position per
  row, and a packed row holds several examples;
* ``train.objective: dpo`` / ``data.format: preference``: the pairwise losses read one log-probability per row
  (chosen and rejected rows side by side);
* ``train.clients_per_pass > 1``: the batched pass routes each row through its own client's factors, while a
  packed micro-batch is one row;
* ``privacy.mechanism: dp_sgd``: opacus clips the gradient of each row, so a packed row's examples would share
  one clipping norm and no single example's gradient would be bounded by it;
* a model type whose attention is not known to take packed position ids (:data:`PACKING_MODEL_TYPES`).

A model whose config cannot be read here (an uncached hub id) is checked again by the client when it trains.
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schema import Recipe


def packing_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` of ``train.packing`` against the rest of the recipe (no torch imported)."""
    if not r.train.packing:
        return []
    from fedllm.data.packing import PACKING_MODEL_TYPES
    from fedllm.models.info import CLASSIFIER_HEADS, model_config

    reasons = []
    config = model_config(r.model) or {}
    model_type = config.get("model_type")
    if r.model.task == "classification" or (r.model.task == "auto" and model_type in CLASSIFIER_HEADS):
        reasons.append("for a sequence classifier (it reads one pooled position per row; a packed row holds "
                       "several examples)")
    elif model_type is not None and model_type not in PACKING_MODEL_TYPES:
        reasons.append(f"for model type {model_type!r} (packing is checked for {', '.join(sorted(PACKING_MODEL_TYPES))}"
                       ": their attention masks follow the packed position ids)")
    if r.train.objective == "dpo" or r.data.format == "preference":
        reasons.append("with train.objective: dpo (the pairwise losses read one log-probability per row, chosen and "
                       "rejected rows side by side)")
    if r.train.clients_per_pass > 1:
        reasons.append(f"with train.clients_per_pass: {r.train.clients_per_pass} (the batched pass routes each row "
                       "through its client's factors; a packed micro-batch is one row)")
    if r.privacy.mechanism == "dp_sgd":
        reasons.append("with privacy.mechanism: dp_sgd (opacus clips each row's gradient: the examples of a packed "
                       "row would share one clipping norm)")
    return [("train.packing", True, f"false {why}") for why in reasons]
