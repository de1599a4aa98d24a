"""Partition a data set into federated clients (the same code as `fedllm partition`).

    python data_prep/partition.py --data data/arith/train.jsonl --num-clients 4 \\
        --method dirichlet --beta 0.5 --column category --seed 0 --out data/arith-dir0.5

writes ``manifest.json`` and ``client_XXX.jsonl`` (and ``eval.jsonl`` with
``--eval-fraction``); train on exactly this split with
``federation.partition.path=<out>``. ``--recipe RECIPE.yaml`` takes every
setting from a recipe.
"""

from __future__ import annotations

import argparse
import sys

from fedllm.commands.partition import add_partition_arguments, run_partition_command
from fedllm.common.errors import InputError


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and partition; returns the exit code (2 on an input error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_partition_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_partition_command(args)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
