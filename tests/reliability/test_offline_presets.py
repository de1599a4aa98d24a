"""Exports of a preset base load, evaluate and serve offline (HF_HUB_OFFLINE=1 in the whole suite)."""

import json
import os

import pytest
import torch

from fedllm.commands.cli import main
from fedllm.export.inference import load_for_inference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def exported(finished_run, tmp_path_factory):
    run_dir, _ = finished_run
    out = tmp_path_factory.mktemp("exports")
    assert main(["export", str(run_dir), "--format", "adapter", "--out", str(out / "adapter")]) == 0
    assert main(["export", str(run_dir), "--format", "merged", "--out", str(out / "merged")]) == 0
    return run_dir, out


def _logits(model, tok, text="What is 3 + 4?"):
    enc = tok(text, return_tensors="pt")
    with torch.no_grad():
        return model(**enc).logits.float()


def test_adapter_and_merged_exports_of_a_preset_load_offline_as_the_run_model(exported):
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    run_dir, out = exported
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-llama"
    assert json.loads((out / "adapter" / "export.json").read_text())["base_model"]["seed"] == 0
    reference = _logits(*load_for_inference(str(run_dir)))
    for kind in ("adapter", "merged"):
        got = _logits(*load_for_inference(str(out / kind)))
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


def test_an_exported_adapter_evaluates_and_serves_offline(exported, tmp_path, capsys):
    from fastapi.testclient import TestClient

    from fedllm.commands.serve import build_app

    _, out = exported
    data = os.path.join(ROOT, "tests", "assets", "eval", "gsm8k_tiny.jsonl")
    assert main(["eval", str(out / "adapter"), "--tasks", "gsm8k", "--data", f"gsm8k={data}", "--limit", "2",
                 "--max-new-tokens", "4", "--out", str(tmp_path / "ev"), "--no-progress"]) == 0, capsys.readouterr().err
    assert "gsm8k" in capsys.readouterr().out
    model, tok = load_for_inference(str(out / "adapter"))
    client = TestClient(build_app(model, tok, "tiny", max_new_tokens_limit=4))
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 4


@pytest.mark.slow
def test_an_adapter_of_the_smollm2_preset_loads_offline(smollm2_quickstart_run, tmp_path):
    """The real SmolLM2-135M GGUF preset: the session's quickstart run (tests/conftest.py, shared with
    tests/test_quickstart.py), its adapter exported and reloaded offline as the run's model."""
    run = smollm2_quickstart_run
    assert run.code == 0
    out = tmp_path / "adapter"
    assert main(["export", str(run.run_dir), "--format", "adapter", "--out", str(out)]) == 0
    reference = _logits(*load_for_inference(str(run.run_dir)))
    torch.testing.assert_close(_logits(*load_for_inference(str(out))), reference, rtol=1e-3, atol=1e-3)
