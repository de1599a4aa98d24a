"""The README quickstart on the real SmolLM2-135M weights (slow: ~3 min on 2 cores)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedllm.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart" / "smollm2-arith-fedavg.yaml"


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_first_load")  # the session converts the GGUF once
def test_quickstart_recipe_trains_and_reports_accuracy_before_and_after(tmp_path, monkeypatch, capsys):
    subprocess.run([sys.executable, str(ROOT / "data_prep" / "make_arith.py"), "--out", str(tmp_path / "data/arith")],
                   check=True)
    monkeypatch.chdir(tmp_path)  # the recipe's data paths are relative to where it is launched
    assert main(["train", str(RECIPE), "output_dir=run"]) == 0
    assert capsys.readouterr().out.strip().endswith("run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before, after = summary["initial_eval"]["gsm8k/accuracy"], summary["final_eval"]["gsm8k/accuracy"]
    assert summary["rounds"] == 4
    assert after > before, (before, after)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == [0, 1, 2, 3, 4]
    assert lines[-1]["train_loss"] < lines[1]["train_loss"]
