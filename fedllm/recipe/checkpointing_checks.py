"""Recipe checks of ``train.gradient_checkpointing`` (:mod:`fedllm.engine.checkpointed`).

Refused, with the reason: a value other than false, true or a positive integer (every k-th decoder layer; 1 is
true). Nothing else is: the key composes with every strategy, SFT and DPO, DP-SGD (opacus records each input once:
the recompute is paused), client-level DP, packing, ``train.compile``, ``train.clients_per_pass``, N processes and
Flower (tests/training/test_gradient_checkpointing.py). A model whose transformers class cannot checkpoint its
layers is refused when it is loaded, naming the key.
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schema import Recipe


def checkpointing_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """``(key, given, expected)`` of ``train.gradient_checkpointing`` (no torch imported)."""
    given = r.train.gradient_checkpointing
    if isinstance(given, bool) or (isinstance(given, int) and given >= 1):
        return []
    return [("train.gradient_checkpointing", given,
             "false, true or a positive integer k (checkpoint every k-th decoder layer)")]
