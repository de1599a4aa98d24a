"""Recipe-load checks of ``federation.mode: async`` (buffered asynchronous aggregation, :mod:`fedllm.engine.fedbuff`).

What FedBuff cannot run with is refused here, each with its reason: a strategy whose aggregation is not the mean of
the clients' model changes (asked of the strategy class, :meth:`fedllm.strategies.base.Strategy.async_problem`),
client-level or sample-level DP (DP-FedBuff's accounting is not the synchronous round's), SecAgg+ (it masks a
synchronous cohort), a round deadline (under async no round waits) and compressed transport (a client's change is
taken against the version it pulled, which the server's download residual does not follow).
"""

from __future__ import annotations

from typing import Any

from fedllm.recipe.schedule import step_seconds
from fedllm.recipe.schema import FederationConfig, Recipe

ASYNC_KEYS = ("async_buffer_size", "async_concurrency", "async_staleness", "async_staleness_exponent",
              "async_step_seconds")
"""The keys that mean something only under ``federation.mode: async``."""

REFUSED_DP = ("none with federation.mode: async: DP-FedBuff's privacy accounting (each upload is released on its own, "
              "at a staleness the server chose) is not the synchronous round's, and fedllm does not implement it")
REFUSED_SECAGG = ("none with federation.mode: async: SecAgg+ masks the sum of a cohort fixed before it trains, and an "
                  "asynchronous server adds each upload as it arrives")
REFUSED_DEADLINE = ("null with federation.mode: async: no server step waits for a cohort; a slow client's upload "
                    "arrives stale and is down-weighted instead")
REFUSED_COMPRESSION = ("none with federation.mode: async (compressed transport is not built for it: a client's change "
                       "is taken against the version it pulled)")


def async_problems(r: Recipe) -> list[tuple[str, Any, str]]:
    """Problems of the ``federation.async_*`` keys and of what ``mode: async`` cannot run with (the strategy is
    asked by :func:`strategy_async_problems`: importing it loads torch)."""
    fed, p, defaults = r.federation, [], FederationConfig()
    if fed.mode != "async":
        return [(f"federation.{k}", getattr(fed, k), "its default (it applies only with federation.mode: async)")
                for k in ASYNC_KEYS if getattr(fed, k) != getattr(defaults, k)]
    if fed.async_buffer_size is not None and fed.async_buffer_size < 1:
        p.append(("federation.async_buffer_size", fed.async_buffer_size, "an integer >= 1, or null"))
    if fed.async_concurrency is not None and not 1 <= fed.async_concurrency <= fed.num_clients:
        p.append(("federation.async_concurrency", fed.async_concurrency,
                  f"an integer in 1..federation.num_clients ({fed.num_clients}), or null"))
    if not fed.async_staleness_exponent >= 0:
        p.append(("federation.async_staleness_exponent", fed.async_staleness_exponent, "a number >= 0"))
    elif fed.async_staleness != "polynomial" and fed.async_staleness_exponent != defaults.async_staleness_exponent:
        p.append(("federation.async_staleness_exponent", fed.async_staleness_exponent,
                  (f"its default (it applies only with federation.async_staleness: polynomial, "
                   f"not {fed.async_staleness})")))
    if step_seconds(fed) is None:
        p.append(("federation.async_step_seconds", fed.async_step_seconds,
                  f"a positive number, or a list of {fed.num_clients} positive numbers (one per client)"))
    why = {
        "privacy.mechanism": (r.privacy.mechanism, r.privacy.mechanism != "none", REFUSED_DP),
        "privacy.secure_aggregation": (r.privacy.secure_aggregation, r.privacy.secure_aggregation != "none",
                                       REFUSED_SECAGG),
        "federation.round_deadline": (fed.round_deadline, fed.round_deadline is not None, REFUSED_DEADLINE),
        "federation.compression.upload": (fed.compression.upload, fed.compression.upload != "none",
                                          REFUSED_COMPRESSION),
        "federation.compression.download": (fed.compression.download, fed.compression.download != "none",
                                            REFUSED_COMPRESSION),
    }
    return p + [(key, given, expected) for key, (given, bad, expected) in why.items() if bad]


def strategy_async_problems(r: Recipe, strategy_cls: Any) -> list[tuple[str, Any, str]]:
    """``federation.mode: async`` with a strategy that cannot aggregate asynchronously (its reason)."""
    reason = strategy_cls.async_problem() if r.federation.mode == "async" else None
    return [("federation.mode", "async", f"sync with federation.strategy {r.federation.strategy!r}: it {reason}")] \
        if reason else []
