"""``fedllm plot RUN_DIR [RUN_DIR ...] --out FILE.png``: runs overlaid round by round (drawn by fedllm.runs.plot)."""

from __future__ import annotations

import argparse
from pathlib import Path

from fedllm.common.errors import InputError
from fedllm.runs.plot import plot_runs


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``fedllm plot`` arguments to ``parser``."""
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (each holds metrics.jsonl)")
    parser.add_argument("--out", default="plot.png", help="PNG file to write (default: plot.png)")
    parser.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")


def run_plot_command(args: argparse.Namespace) -> int:
    """Run ``fedllm plot`` from parsed arguments; prints the PNG path."""
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        raise InputError(f"--labels: got {len(labels)} label(s) for {len(args.runs)} run(s)")
    print(plot_runs([Path(r) for r in args.runs], Path(args.out), labels))
    return 0
