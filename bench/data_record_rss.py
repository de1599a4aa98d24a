"""Peak RSS of building a run's data when one record holds 100 MiB of text (``data.max_record_chars``).

    python bench/data_record_rss.py write   # writes /tmp/fedllm_big_record.jsonl (24 records, one of 100 MiB)
    python bench/data_record_rss.py         # builds the federated data from it (in a fresh process)
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
PATH = "/tmp/fedllm_big_record.jsonl"


def main() -> None:
    from tests.conftest import arith_records

    if sys.argv[1:] == ["write"]:
        records = arith_records(24)
        records[5]["question"] = "x " * (50 << 20)
        with open(PATH, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        return
    from fedllm.data import build_federated_data
    from fedllm.models.loading import load_tokenizer, resolve_task
    from fedllm.recipe.checks import parse_recipe

    r = parse_recipe({"model": {"name": "tiny-llama"}, "federation": {"num_clients": 3},
                      "data": {"path": PATH, "cache": False, "fields": {"instruction": "question", "output": "answer"}},
                      "train": {"local_steps": 1, "max_length": 64}})
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    started = time.time()
    fed = build_federated_data(r.data, r.federation.partition, 3, load_tokenizer(r.model), 64, 0,
                               resolve_task(r.model))
    too_large = sum(c["too_large"] for c in fed.manifest["bad_records"]["counts"].values())
    print(f"{time.time() - started:.1f} s; peak RSS {before:.0f} -> "
          f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; too_large records: {too_large}")


if __name__ == "__main__":
    main()
