"""Write preference pairs from the synthetic arithmetic problems (the SFT quickstart's data).

    python data_prep/make_arith_preferences.py --out data/arith_pref --train 400 --test 100 --seed 0

writes ``train.jsonl`` and ``test.jsonl`` with ``question``, ``answer`` (the worked correct answer, ending in
``#### <number>``: the chosen one), ``rejected`` (the same solution with a plausible wrong result) and
``category``. Train on it with ``data.format: preference`` and ``data.fields: {prompt: question, chosen: answer}``;
the ``question``/``answer`` columns also serve the ``gsm8k`` task.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from fedllm.data.synthetic_preferences import arith_preference_splits


def main(argv: list[str] | None = None) -> int:
    """Parse arguments and write the two splits; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--train", type=int, default=400, help="training pairs")
    parser.add_argument("--test", type=int, default=100, help="test pairs")
    parser.add_argument("--seed", type=int, default=0, help="seed (same seed, same files)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = arith_preference_splits(args.train, args.test, args.seed)
    for split, rows in zip(("train", "test"), splits, strict=True):
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        print(f"{path}: {len(rows)} pairs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
