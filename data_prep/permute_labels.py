"""Split a classification data set into clients in label-permuted groups (pFL^MF's setup 3).

    python data_prep/permute_labels.py --data data/arith/train.jsonl --column category \\
        --num-clients 8 --groups 4 --seed 0 --out data/arith-permuted

writes ``data.jsonl`` (every record once, with its group's label and ``client`` / ``group``
columns) and ``groups.json`` (each group's label map). Train on it with
``data.path=<out>/data.jsonl`` and ``federation.partition: {method: natural, column: client}``
(``federation.num_clients`` = ``--num-clients``). ``--beta B`` splits by Dirichlet(B) label skew
before permuting instead of evenly at random.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedllm.common.errors import InputError
from fedllm.data.errors import DataError
from fedllm.data.label_groups import permute_label_groups
from fedllm.data.loading import load_records
from fedllm.data.partition import partition_records, resolve_column
from fedllm.recipe.schema import PartitionConfig


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, permute and write; returns the exit code (2 on an input error)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="classification records (json/jsonl/csv/parquet or hub id)")
    parser.add_argument("--column", default=None, help="label column (default: label, then category)")
    parser.add_argument("--num-clients", type=int, required=True, help="clients; client c is in group c %% groups")
    parser.add_argument("--groups", type=int, required=True, help="label-permuted groups (group 0 keeps the labels)")
    parser.add_argument("--beta", type=float, default=None, help="Dirichlet(beta) label skew instead of an even split")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the permutations")
    parser.add_argument("--out", required=True, help="output directory")
    args = parser.parse_args(argv)
    try:
        if args.beta is not None and args.beta <= 0:
            raise DataError(f"--beta {args.beta}: expected a positive number")
        records = load_records(args.data, None, "train")
        column = resolve_column(records, args.column)
        parts = None
        if args.beta is not None:
            parts = partition_records(records, args.num_clients, args.seed,
                                      PartitionConfig(method="dirichlet", beta=args.beta, column=column))
        rows, maps = permute_label_groups(records, args.num_clients, args.groups, args.seed, column, parts)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (out / "groups.json").write_text(json.dumps({"column": column, "maps": [{str(k): v for k, v in m.items()}
                                                                             for m in maps]}, indent=1))
    print(f"{out / 'data.jsonl'}: {len(rows)} records, {args.num_clients} clients in {args.groups} groups")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
