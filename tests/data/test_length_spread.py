"""data_prep/make_length_spread.py: Alpaca-format records with long-tailed (log-normal) lengths, seeded."""

import json
import math
import statistics

from fedllm.data.synthetic_lengths import MAX_WORDS, length_spread_records


def test_lengths_follow_the_log_normal_they_are_drawn_from():
    records = length_spread_records(4000, seed=0)
    out = sorted(len(r["output"].split()) for r in records)
    # log-normal(ln 60, 1.0): median 60 words, 90th percentile 60·e^1.2816 = 216, 10th 60·e^-1.2816 = 16.7
    assert 54 <= statistics.median(out) <= 66
    assert 190 <= out[int(0.9 * len(out))] <= 245 and 14 <= out[int(0.1 * len(out))] <= 19.5
    assert out[0] >= 2 and out[-1] <= MAX_WORDS
    assert abs(sum(r["input"] != "" for r in records) / len(records) - 0.4) < 0.03
    assert math.isclose(statistics.median(len(r["instruction"].split()) for r in records), 14, abs_tol=1.5)


def test_the_same_seed_writes_the_same_file(tmp_path):
    from data_prep.make_length_spread import main

    assert main(["--out", str(tmp_path / "a"), "--train", "50", "--seed", "3"]) == 0
    assert main(["--out", str(tmp_path / "b"), "--train", "50", "--seed", "3"]) == 0
    a = (tmp_path / "a" / "train.jsonl").read_text()
    assert a == (tmp_path / "b" / "train.jsonl").read_text()
    rows = [json.loads(x) for x in a.splitlines()]
    assert len(rows) == 50 and all(set(r) == {"instruction", "input", "output"} for r in rows)
    assert rows != length_spread_records(50, seed=4)
