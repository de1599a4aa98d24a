"""Write an instruction data set with Alpaca-like, long-tailed lengths (for measuring padding and packing).

    python data_prep/make_length_spread.py --out data/length_spread --train 2000 --seed 0

writes ``train.jsonl`` with ``instruction``, ``input`` (empty in most records) and ``output``: log-normal word
counts from a few words to several hundred (:mod:`fedllm.data.synthetic_lengths`). Train on it with
``data.format: instruction`` (the default Alpaca columns); ``bench/packing.py`` does.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedllm.data.synthetic_lengths import length_spread_records


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and write the records; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=2000, help="records")
    parser.add_argument("--seed", type=int, default=0, help="seed (same seed, same file)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = length_spread_records(args.train, args.seed)
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{path}: {len(rows)} records")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
