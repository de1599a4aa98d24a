"""Differential privacy around fedllm's strategies (docs/privacy.md).

- client-level DP (``privacy.mechanism: central`` / ``central_client_clipping``): :mod:`fedllm.privacy.central`;
- sample-level DP-SGD on each client with opacus (``dp_sgd``): :mod:`fedllm.privacy.dp_sgd`;
- accounting with Google's dp-accounting (and opacus's for DP-SGD): :mod:`fedllm.privacy.accounting`;
- which strategies each mechanism can wrap, checked at recipe load: :mod:`fedllm.privacy.recipe_checks`.

Robust aggregation (Krum, Bulyan, median, trimmed mean) lives in ``fedllm/strategies/``.
"""

from __future__ import annotations

from typing import Any


def with_privacy(strategy: Any, recipe: Any) -> Any:
    """``strategy`` with the recipe's privacy mechanism mixed in (unchanged when it is ``none``).

    The result is the same strategy (its attributes) as an instance of ``(mechanism mixin, its class)``: every
    hook of the strategy stays, the mixin overrides the few it needs (``aggregate``, ``client_upload`` ...) and
    calls the strategy's own through ``super()``.
    """
    mechanism = recipe.privacy.mechanism
    if mechanism == "none":
        return strategy
    if mechanism == "dp_sgd":
        from fedllm.privacy.dp_sgd import SampleLevelDP as mixin
    else:
        from fedllm.privacy.central import ClientLevelDP as mixin
    inner = type(strategy)
    batching = inner.client_batching_problem() is None and mechanism != "dp_sgd"
    cls = type(f"{mixin.__name__}{inner.__name__}", (mixin, inner),
               {"client_batching": batching, "__module__": mixin.__module__})
    private = cls.__new__(cls)
    private.__dict__.update(strategy.__dict__)  # the same strategy, its arguments and state, with the mixin's hooks
    private.bind_privacy(recipe)
    return private
