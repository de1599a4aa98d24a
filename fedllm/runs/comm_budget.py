"""A run's communication against a budget (``federation.communication_budget_mb``), as FlowerTune counts it.

FlowerTune's LLM leaderboard (flwrlabs/flower ``examples/flowertune-llm-*/…/strategy.py``,
``CommunicationTracker``) adds up, over the whole run, the bytes of the adapter arrays the server sends to the
sampled clients (``configure_train``) and of those the clients send back (``aggregate_train``), divides by
``1024**2`` and compares the sum with **200,000 MB**; going over is a warning ("consider reducing it if you plan
to participate [in the] FlowerTune LLM Leaderboard"), not a stop. fedllm counts the same two directions in
``metrics.jsonl`` (``bytes_down_total`` / ``bytes_up_total``, from the strategy's own byte hooks, so compressed
updates count as compressed), and this module turns them into MB of ``1024**2`` bytes, the share of the budget and
the projection for a whole run that ``--dry-run`` prints.
"""

from __future__ import annotations

from typing import Any

MB = 1024**2
"""Bytes per MB in FlowerTune's tracker (``count_bytes() / 1024**2``)."""

FLOWERTUNE_BUDGET_MB = 200_000.0
"""FlowerTune LLM leaderboard's communication budget for a whole run."""


def projected_bytes(round_up: int, round_down: int, rounds: int) -> int:
    """Bytes of a whole run from one round's upload and download (every round moves the same: the sampled-client
    count and the adapter's size are fixed by the recipe; a strategy whose bytes change per round is estimated
    from round 1)."""
    return rounds * (round_up + round_down)


def usage(total_bytes: int, budget_mb: float | None) -> dict[str, Any]:
    """``summary.json``'s ``communication`` entry: total MB, and with a budget its share and whether it fits.

    Args:
        total_bytes: bytes up plus bytes down of every round.
        budget_mb: ``federation.communication_budget_mb`` (None: no budget).
    """
    total_mb = total_bytes / MB
    out: dict[str, Any] = {"total_bytes": int(total_bytes), "total_mb": round(total_mb, 6), "mb_unit_bytes": MB}
    if budget_mb is not None:
        out.update(budget_mb=budget_mb, budget_share=round(total_mb / budget_mb, 8),
                   within_budget=bool(total_mb <= budget_mb))
    return out


def summary_line(entry: dict[str, Any]) -> str:
    """The run's closing line on its communication (from :func:`usage`'s entry)."""
    line = f"communication: {entry['total_mb']:,.2f} MB up + down (MB = 1024**2 bytes)"
    if "budget_mb" in entry:
        line += f", {100 * entry['budget_share']:.2f}% of the budget of {entry['budget_mb']:,g} MB"
    return line


def over_budget_warning(total_mb: float, budget_mb: float, projected: bool) -> str:
    """The warning printed when a run uses (or would use) more than its budget."""
    verb = "would move" if projected else "moved"
    return (f"warning: the run {verb} {total_mb:,.2f} MB, over federation.communication_budget_mb "
            f"({budget_mb:,g} MB; MB = 1024**2 bytes, up + down, as FlowerTune counts): reduce it (fewer or "
            f"smaller updates) if the run is meant for a leaderboard with this budget")


def projection_lines(round_up: int, round_down: int, rounds: int, budget_mb: float | None) -> list[str]:
    """``--dry-run``'s lines on the whole run's bytes (and its budget, with its warning when over)."""
    total = projected_bytes(round_up, round_down, rounds)
    line = (f"  communication for the whole run: {total / MB:,.2f} MB (MB = 1024**2 bytes) = {rounds} rounds x "
            f"(up {round_up / MB:,.3f} + down {round_down / MB:,.3f} MB)")
    if budget_mb is None:
        return [line]
    share = usage(total, budget_mb)
    lines = [line + f"; {100 * share['budget_share']:.2f}% of the budget of {budget_mb:,g} MB"]
    if not share["within_budget"]:
        lines.append("  " + over_budget_warning(total / MB, budget_mb, projected=True))
    return lines
