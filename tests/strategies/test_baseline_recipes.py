"""The RTE baseline recipes (FRLoRA paper, Table 1) run on the classification path with a tiny RoBERTa."""

from pathlib import Path

import pytest

from fedllm.engine.server import run
from fedllm.recipe.checks import load_recipe

ROOT = Path(__file__).resolve().parents[2]
BASELINES = ["fedprox", "scaffold", "fedavgm", "fedadagrad", "fedyogi", "fedadam", "ffa-lora"]


@pytest.fixture(scope="module")
def runs(data_files, tmp_path_factory):
    """Each recipe with its strategy and arguments as written, shrunk to tiny-roberta, 2 rounds, 1 step."""
    out = {}
    for name in ["fedavg"] + BASELINES:
        rel = ("recipes/frlora/" if name == "fedavg" else "recipes/baselines/") + f"roberta-base-rte-{name}.yaml"
        recipe = load_recipe(ROOT / rel, [
            f"output_dir={tmp_path_factory.mktemp(name) / 'run'}", f"data.path={data_files['sentiment']}",
            "model.name=tiny-roberta", "data.name=null", "data.eval_split=null", "data.fields={}",
            "federation.rounds=2", "train.local_steps=1", "train.batch_size=4", "train.max_length=32",
            "eval.tasks=[]", "checkpoint.every=0", "logging.quiet=true"])
        out[name] = run(recipe)
    return out


@pytest.mark.parametrize("name", BASELINES)
def test_rte_baseline_recipe_trains_the_head_and_counts_its_bytes(name, runs):
    result, fedavg = runs[name], runs["fedavg"]
    assert result.strategy.name == name.replace("-", "_")
    assert any(".classifier." in k for k in result.global_state)  # the head is aggregated too
    full = sum(v.numel() * 4 for v in fedavg.global_state.values())
    a = sum(v.numel() * 4 for k, v in fedavg.global_state.items() if ".lora_A." in k)
    expected = {"scaffold": 2 * full, "ffa-lora": full - a}.get(name, full)  # + Δc / − A
    for h in result.history:
        assert set(h["bytes_up"].values()) == {expected} and len(h["bytes_up"]) == 5
