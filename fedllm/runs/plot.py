"""Runs overlaid, round by round, in one PNG (``fedllm plot``, and every finished run's ``plot.png``).

Panels: train loss, each eval metric any run recorded, and cumulative bytes (up + down).
Each run is one line, labelled ``<run dir name> (<strategy>)``. The figure is
``PANEL_SIZE`` pixels per panel, at most three panels a row. Every finished run writes
its own ``plot.png`` beside ``summary.json`` through :func:`plot_runs`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from fedllm.common.errors import InputError

PANEL_SIZE = (400, 300)  # pixels per panel (at DPI)
DPI = 100
PANELS_PER_ROW = 3


def read_history(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``; InputError naming the path when there is none."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise InputError(f"{run_dir}: not a run directory (no metrics.jsonl)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _label(run_dir: Path) -> str:
    recipe = run_dir / "recipe.yaml"
    if recipe.is_file():
        for line in recipe.read_text().splitlines():
            if line.strip().startswith("strategy:"):
                strategy = line.split(":", 1)[1].strip()
                return run_dir.name if strategy == run_dir.name else f"{run_dir.name} ({strategy})"
    return run_dir.name


def series(history: list[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``panel -> (rounds, values)``: train loss, ``eval/<metric>`` and cumulative bytes."""
    out: dict[str, tuple[list[int], list[float]]] = {}

    def add(name: str, rnd: int, value: float) -> None:
        xs, ys = out.setdefault(name, ([], []))
        xs.append(rnd)
        ys.append(value)

    total = 0.0
    for rec in history:
        rnd = int(rec.get("round", 0))
        if "train_loss" in rec:
            add("train loss", rnd, rec["train_loss"])
        for metric, value in rec.get("eval", {}).items():
            if isinstance(value, (int, float)):
                add(f"eval {metric}", rnd, value)
        if "bytes_up_total" in rec:
            total += rec["bytes_up_total"] + rec.get("bytes_down_total", 0)
            add(COMM_AXIS, rnd, total / MB)
    return out


MB = 1024**2
"""Bytes per MB, on the plot as on the console and in summary.json (FlowerTune's ``count_bytes() / 1024**2``)."""
COMM_AXIS = "cumulative MB (up + down; MB = 1024**2 bytes)"


def plot_runs(run_dirs: list[Path], out: Path, labels: Optional[list[str]] = None) -> Path:
    """Overlay the runs in ``run_dirs`` and save a PNG at ``out``; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(labels[i] if labels else _label(Path(d)), series(read_history(Path(d)))) for i, d in enumerate(run_dirs)]
    panels: list[str] = []
    for _, s in runs:
        panels += [p for p in s if p not in panels]
    panels.sort(key=lambda p: (not p.startswith("train"), p.startswith("cumulative"), p))
    if not panels:
        raise InputError(f"{', '.join(map(str, run_dirs))}: no rounds recorded yet, nothing to plot")
    cols = min(PANELS_PER_ROW, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(cols * PANEL_SIZE[0] / DPI, rows * PANEL_SIZE[1] / DPI),
                             dpi=DPI, squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        for label, s in runs:
            if panel in s:
                ax.plot(*s[panel], marker="o", markersize=3, label=label)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("round", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=DPI)
    plt.close(fig)
    return out
