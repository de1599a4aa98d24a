"""The tiny, offline variants of the FRLoRA / FedLoRU / baseline recipes run end to end; their losses are pinned."""

import json
from pathlib import Path

import pytest

from fedllm.engine.server import run
from fedllm.recipe.checks import load_recipe

ROOT = Path(__file__).resolve().parents[2]

# Mean client training loss per round, on the fixture files written by conftest.data_files (1 thread).
PINNED = {
    "recipes/frlora/tiny-llama-arith-frlora.yaml": [6.317242, 6.179464, 6.132273],
    "recipes/frlora/tiny-roberta-sentiment-frlora.yaml": [0.689339, 0.711351, 0.718133],
    "recipes/fedloru/tiny-llama-arith-fedloru.yaml": [6.311686, 6.135612, 6.04489, 6.119181],
    "recipes/fedloru/tiny-llama-arith-pfedloru.yaml": [6.30929, 6.137065, 6.100827, 6.085454],
    "recipes/fedloru/tiny-llama-arith-mfedloru.yaml": [6.321018, 6.191361, 6.136873, 6.182478],
    "recipes/baselines/tiny-llama-arith-fedprox.yaml": [6.311686, 6.13527, 6.044511],
    "recipes/baselines/tiny-llama-arith-scaffold.yaml": [6.311686, 6.133934, 6.043289],
    "recipes/baselines/tiny-llama-arith-fedavgm.yaml": [6.311686, 6.135254, 6.037132],
    "recipes/baselines/tiny-llama-arith-fedadagrad.yaml": [6.311686, 6.168715, 6.055392],
    "recipes/baselines/tiny-llama-arith-fedyogi.yaml": [6.311686, 6.199863, 6.065264],
    "recipes/baselines/tiny-llama-arith-fedadam.yaml": [6.311686, 6.218639, 6.114342],
    "recipes/baselines/tiny-llama-arith-ffa-lora.yaml": [6.311686, 6.180845, 6.053154],
    "recipes/baselines/tiny-llama-arith-flexlora.yaml": [6.315545, 6.149431, 6.043921],
    "recipes/baselines/tiny-llama-arith-flora.yaml": [6.315545, 6.171185, 6.086835],
    "recipes/baselines/tiny-llama-arith-fedex-lora.yaml": [6.311686, 6.134482, 6.043981],
    "recipes/baselines/tiny-llama-arith-fedsa-lora.yaml": [6.323935, 6.196754, 6.192675],
    "recipes/baselines/tiny-llama-arith-hetlora.yaml": [6.315545, 6.202011, 6.064313],
    "recipes/baselines/tiny-llama-arith-rolora.yaml": [6.311687, 6.184796, 6.053103],
    "recipes/baselines/tiny-llama-arith-lora-fair.yaml": [6.311687, 6.135231, 6.044257],
    "recipes/baselines/tiny-llama-arith-fedsvd.yaml": [6.311687, 6.168723, 6.04607],
    "recipes/baselines/tiny-llama-arith-fed-sb.yaml": [6.080865, 6.110788, 6.071296],
    "recipes/personal/tiny-llama-arith-fedlora-pfl.yaml": [6.244783, 6.176367, 6.129053],
    "recipes/personal/tiny-llama-arith-local.yaml": [6.323935, 6.200778, 6.211506],
    "recipes/personal/tiny-llama-arith-pflmf.yaml": [6.369068, 6.252893, 6.142917],
    "recipes/personal/tiny-roberta-sentiment-fedlora-pfl-sim.yaml": [0.662523, 0.701648, 0.707857],
}


def test_every_tiny_recipe_is_pinned():
    found = {str(p.relative_to(ROOT)) for p in (ROOT / "recipes").glob("*/tiny-*.yaml")}
    found = {f for f in found if f.startswith(("recipes/frlora/", "recipes/fedloru/", "recipes/baselines/",
                                                 "recipes/personal/"))}
    assert found == set(PINNED)


@pytest.mark.parametrize("rel", sorted(PINNED))
def test_tiny_recipe_runs_offline_with_pinned_losses(rel, data_files, tmp_path):
    data = data_files["sentiment" if "sentiment" in rel else "arith"]
    recipe = load_recipe(ROOT / rel, [f"output_dir={tmp_path / 'run'}", f"data.path={data}", "logging.quiet=true",
                                      "train.dtype=fp32"])  # the pinned losses are fp32's (auto: bf16 where native)
    result = run(recipe)
    assert [h["train_loss"] for h in result.history] == pytest.approx(PINNED[rel], rel=1e-3)
    summary = json.loads((result.run_dir / "summary.json").read_text())
    local = recipe.federation.strategy == "local"  # local-only training sends nothing
    assert (summary["bytes_up_total"] > 0 and summary["bytes_down_total"] > 0) != local
    if recipe.eval.personal:  # every client's personal model scored on its own held-out split
        personal = result.history[-1]["personal_eval"]
        assert set(personal) == {str(c) for c in range(recipe.federation.num_clients)}
        metric = recipe.eval.tasks[0] + "/accuracy"
        assert all(metric in m for m in personal.values())
        assert summary["final_personal_eval_stats"][metric]["clients"] == recipe.federation.num_clients
