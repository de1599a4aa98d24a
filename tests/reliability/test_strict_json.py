"""metrics.jsonl and summary.json are standard JSON: a non-finite number is written as null."""

import json
import math

import pytest

from fedllm.engine.server import RoundLoop
from fedllm.runs import strict_json


def test_non_finite_numbers_become_null_at_any_depth():
    record = {"round": 1, "train_loss": math.nan, "eval": {"loss": math.inf, "acc": 0.5},
              "client_loss": [1.0, -math.inf], "note": "NaN stays a string"}
    text = strict_json.dumps(record)
    assert json.loads(text, parse_constant=pytest.fail) == {
        "round": 1, "train_loss": None, "eval": {"loss": None, "acc": 0.5}, "client_loss": [1.0, None],
        "note": "NaN stays a string"}
    assert "NaN" not in text.replace("NaN stays", "") and "Infinity" not in text


def test_a_nan_eval_metric_reaches_metrics_and_summary_as_null(tiny_recipe, monkeypatch):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    monkeypatch.setattr(RoundLoop, "evaluate", lambda self, rnd, *a, **k: {"eval_loss": math.nan})
    result = run(parse_recipe(tiny_recipe(federation={"rounds": 1}, eval={"tasks": ["gsm8k"], "before_training": True})))
    rows = [json.loads(x, parse_constant=pytest.fail) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0] == {"round": 0, "eval": {"eval_loss": None}}
    summary = json.loads((result.run_dir / "summary.json").read_text(), parse_constant=pytest.fail)
    assert summary["final_eval"] == {"eval_loss": None}
