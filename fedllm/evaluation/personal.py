"""Summaries of personalized evaluation: each client's model on its own held-out split."""

from __future__ import annotations

from typing import Any


def personal_stats(per_client: dict[str, dict[str, float]]) -> dict[str, dict[str, Any]]:
    """``{metric: {"mean", "min", "max", "argmin", "argmax", "clients"}}`` over the clients that report it.

    Args:
        per_client: ``{client id: {metric: value}}`` (the ``personal_eval`` of a round record).

    Returns:
        Per metric the unweighted mean over clients, the worst and best client's value and id, and
        how many clients reported it.
    """
    values: dict[str, list[tuple[float, str]]] = {}
    for cid, metrics in per_client.items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(key, []).append((float(value), cid))
    out: dict[str, dict[str, Any]] = {}
    for key, pairs in sorted(values.items()):
        lo, hi = min(pairs), max(pairs)
        out[key] = {"mean": sum(v for v, _ in pairs) / len(pairs), "min": lo[0], "max": hi[0],
                    "argmin": lo[1], "argmax": hi[1], "clients": len(pairs)}
    return out
