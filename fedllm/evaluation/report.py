"""Markdown table of flat evaluation metrics (``task/metric -> value``)."""

from __future__ import annotations

import math


def _fmt(value: float) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "n/a"
    return f"{value:.4f}" if isinstance(value, float) and not value.is_integer() else f"{value:g}"


def markdown_table(metrics: dict[str, float], title: str = "") -> str:
    """A ``| task | metric | value |`` table, one row per metric, in the given order."""
    lines = [f"**{title}**", ""] if title else []
    lines += ["| task | metric | value |", "| --- | --- | ---: |"]
    for key, value in metrics.items():
        task, _, metric = key.partition("/")
        lines.append(f"| {task} | {metric or '-'} | {_fmt(value)} |")
    return "\n".join(lines)
