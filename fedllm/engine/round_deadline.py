"""A round deadline (``federation.round_deadline``): which clients of a round arrived too late to be aggregated.

A round waits ``seconds`` for its clients' uploads, or ``multiple`` x the time at which the median client's upload
arrived (``"2x"``: twice the median client time); never less than the time at which ``min_clients`` uploads had
arrived, so a round aggregates at least ``federation.min_clients_per_round`` of them. A later upload is late: the
round loop drops it as it drops a failed client (its per-client state stays as before the round, so its next round
starts from the global state of then), records it in ``metrics.jsonl`` (``late``) and in ``summary.json``, and each
strategy says what that means for it (:attr:`fedllm.strategies.base.Strategy.late_update`). Under SecAgg+ a late
client is a dropout: the survivors' sum is unmasked as for any client that sent nothing.

An upload's arrival time (:func:`arrival_seconds`) is counted from the round's start: on Flower, when its reply
reached the ServerApp; in simulation, where clients train one after another, each client's own training time, as if
every client trained on its own machine at once.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from fedllm.recipe.schema import round_deadline


@dataclass(frozen=True)
class RoundDeadline:
    """``seconds`` or ``multiple`` (of the median client time), and the fewest uploads a round waits for."""

    seconds: float | None
    multiple: float | None
    min_clients: int

    @classmethod
    def of(cls, value: Any, min_clients: int) -> RoundDeadline | None:
        """The deadline ``federation.round_deadline`` gives (None: no deadline)."""
        if value is None:
            return None
        number, relative = round_deadline(value)
        return cls(None if relative else number, number if relative else None, min_clients)

    def describe(self) -> str:
        """How long a round waits, in words."""
        what = f"{self.seconds:g} s" if self.seconds is not None else f"{self.multiple:g}x the median client time"
        return f"{what}, and at least until {self.min_clients} upload(s) arrived"

    def limit(self, arrivals: list[float], sampled: int) -> float:
        """The round's deadline in seconds from its start, given the arrival times known (of ``sampled`` clients)."""
        times = sorted(arrivals)
        if self.seconds is not None:
            limit = self.seconds
        else:  # the median of all sampled clients: a client that never arrived counts as latest
            padded = times + [math.inf] * (sampled - len(times))
            limit = self.multiple * statistics.median_low(padded) if padded else math.inf
        floor = times[self.min_clients - 1] if len(times) >= self.min_clients else math.inf
        return max(limit, floor)

    def late(self, arrivals: dict[int, float], sampled: int) -> tuple[dict[int, float], float]:
        """``({client: arrival seconds} of the late ones, the deadline)`` for the round's ``arrivals``."""
        limit = self.limit(list(arrivals.values()), sampled)
        return {c: t for c, t in arrivals.items() if t > limit}, limit


def arrival_seconds(update: Any) -> float:
    """When ``update`` reached the server, in seconds from its round's start (see the module docstring)."""
    if getattr(update, "arrival_s", None) is not None:
        return float(update.arrival_s)
    work = update.work
    return float(work.get("seconds", 0.0) if isinstance(work, dict) else getattr(work, "seconds", 0.0))
