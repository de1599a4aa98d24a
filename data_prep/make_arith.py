"""Write the synthetic arithmetic word-problem data set (GSM8K format).

    python data_prep/make_arith.py --out data/arith --train 2000 --test 200 --seed 0

writes ``train.jsonl`` and ``test.jsonl`` with ``question``, ``answer`` (ending in
``#### <number>``) and ``category`` (add, sub, mul, div). Train on it with
``data.fields: {instruction: question, output: answer}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedllm.data.synthetic import arith_splits


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and write the two splits; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=2000, help="training problems")
    parser.add_argument("--test", type=int, default=200, help="test problems")
    parser.add_argument("--seed", type=int, default=0, help="seed (same seed, same files)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in zip(("train", "test"), arith_splits(args.train, args.test, args.seed), strict=True):
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
