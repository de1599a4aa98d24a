"""The README quickstart on the real SmolLM2-135M weights (slow: ~3 min on 2 cores).

The run is the session's ``smollm2_quickstart_run`` (tests/conftest.py): README's command as written, run once;
tests/reliability/test_offline_presets.py exports the same run's adapter.
"""

import json

import pytest


@pytest.mark.slow
def test_quickstart_recipe_trains_and_reports_accuracy_before_and_after(smollm2_quickstart_run):
    run = smollm2_quickstart_run
    assert run.code == 0
    assert run.printed.strip().endswith("run")
    summary = json.loads((run.run_dir / "summary.json").read_text())
    before, after = summary["initial_eval"]["gsm8k/accuracy"], summary["final_eval"]["gsm8k/accuracy"]
    assert summary["rounds"] == 4
    assert after > before, (before, after)
    lines = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2, 3, 4]
    assert lines[-1]["train_loss"] < lines[1]["train_loss"]
