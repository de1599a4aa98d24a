"""The DPO quickstart on the real SmolLM2-135M weights, scaled down to fit CI (slow).

recipes/quickstart/smollm2-arith-dpo.yaml itself (10 clients, 5 rounds, 400 pairs) is measured in
docs/preference.md; here the same recipe runs on 12 pairs, 3 clients (2 a round, each with its own reference
computed before round 1), 2 rounds of 6 steps of one pair, and must move the reward accuracy on 16 held-out pairs
from exactly 0 (the starting model is the reference) to a clear majority. Measured in fp32 (what `auto` picks
without avx512_bf16): accuracy 0.9375 (15 of 16), margin 0.40, against bars of 0.75 and 0.1. Half the pair
updates of the previous setting (40 pairs, 2 rounds of 3 steps of 4 pairs), in twice the optimizer steps.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedllm.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart" / "smollm2-arith-dpo.yaml"


@pytest.mark.slow
@pytest.mark.usefixtures("smollm2_first_load")  # the session converts the GGUF once
def test_preference_quickstart_learns_scaled_down(tmp_path, monkeypatch, capsys):
    script = ROOT / "data_prep" / "make_arith_preferences.py"
    subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path / "data/arith_pref"), "--train", "12", "--test", "16"],
        check=True,
    )
    monkeypatch.chdir(tmp_path)
    overrides = [
        "output_dir=run",
        "federation.num_clients=3",
        "federation.clients_per_round=2",
        "federation.rounds=2",
        "federation.partition.method=iid",
        "train.local_steps=6",  # 6 steps of 1 pair learn more than 3 of 4 pairs (Adam: each step moves as far)
        "train.batch_size=1",
        "eval.tasks=[pref_accuracy]",
        "eval.limit=16",
        "eval.batch_size=8",
        "checkpoint.every=0",  # fp32, as the recipe pins: the accuracy bar was checked in fp32 (0.9375, margin 0.40)
    ]
    assert main(["train", str(RECIPE), *overrides]) == 0
    assert capsys.readouterr().out.strip().endswith("run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    before, after = summary["initial_eval"], summary["final_eval"]
    assert before["pref_accuracy/accuracy"] == 0.0 and before["pref_accuracy/margin"] == 0.0
    assert after["pref_accuracy/accuracy"] >= 0.75, after
    assert after["pref_accuracy/margin"] > 0.1, after
    clients = tmp_path / "run" / "final" / "clients.safetensors"
    assert clients.is_file()  # the per-client references are checkpointed
