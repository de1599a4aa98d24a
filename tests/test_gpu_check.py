"""bench/gpu_check.py's CPU path (``--dry``): the same code the GPU check runs, on tiny shapes, in seconds."""

import json
import math
import re
from pathlib import Path

import pytest

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    return load_script(ROOT / "bench" / "gpu_check.py")


def test_dry_run_trains_measures_mfu_and_compares_with_its_reference(gpu_check, tmp_path, capsys):
    out, ref = tmp_path / "check.json", tmp_path / "ref.json"
    assert gpu_check.main(["--dry", "--models", "smollm2-135m", "--configs", "fp32,bf16", "--json", str(out),
                           "--save-ref", str(ref), "--work-dir", str(tmp_path / "work")]) == 0
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["config"], r["strategy"]) for r in rows] == [("fp32", "fedavg"), ("fp32", "frlora"),
                                                            ("bf16", "fedavg"), ("bf16", "frlora")]
    for r in rows:
        assert "error" not in r and not r["dropped"]
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert r["memory_estimate"] > 0
        for rnd in r["rounds_detail"]:  # 2 clients x 1 step x batch 2 x 48 tokens, no padding
            assert rnd["tokens"] == 2 * 2 * 48 and rnd["padded_positions"] == 0 and rnd["tokens_per_s"] > 0
        check = r["flop_check"]  # the formula against torch's FLOP counter on a real micro-batch
        assert check["formula"] == pytest.approx(check["flop_counter"], rel=1e-9)
        assert r["peak_probe"] > 0 and r["mfu_probe"] == pytest.approx(r["flops_per_s"] / r["peak_probe"])
    assert [r["dense_residual"] for r in rows] == [False, False, False, True]  # FRLoRA on bf16: hooked residual
    table = capsys.readouterr().out.split("MFU probe", 1)[1]  # the printed table: an MFU in % on every row
    assert len(re.findall(r" \d+\.\d\d% ", table)) == len(rows)
    saved = json.loads(ref.read_text())
    assert set(saved["runs"]) == {"smollm2-135m/fedavg/b2x48", "smollm2-135m/frlora/b2x48"}
    again = gpu_check.summarise(dict(rows[0]), {}, saved)  # a run beside its own reference: no difference
    assert again["cpu_losses"] == rows[0]["losses"] and again["max_abs_loss_diff"] == 0


def test_paper_7b_rows_take_the_paper_recipes_lora_frlora_and_checkpointing(gpu_check, tmp_path, monkeypatch):
    """``--paper-7b`` (issue 48 item 6), tiny here: the recipe each row runs has the FRLoRA paper recipe's LoRA
    (r=32 on q/v), its FRLoRA arguments and checkpointing on, in bf16 and on the recipe's 8-bit base; FLOPs counted
    for those targets."""
    recipes = []
    real = gpu_check.recipe_for
    monkeypatch.setattr(gpu_check, "recipe_for", lambda *a, **k: recipes.append(real(*a, **k)) or recipes[-1])
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry", "--paper-7b", "--configs", "bf16,8bit", "--json", str(out),
                           "--work-dir", str(tmp_path / "work")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["config"], r["strategy"], r["compile"]) for r in rows] == [
        ("llama2-7b", c, s, False) for c in ("bf16", "8bit") for s in ("fedavg", "frlora")]
    for r in rows:
        assert "error" not in r and r["flop_check"]["formula"] == pytest.approx(r["flop_check"]["flop_counter"],
                                                                                rel=1e-9)
    assert [(x.lora.r, x.lora.alpha, list(x.lora.target_modules), x.train.gradient_checkpointing) for x in recipes] \
        == [(32, 64, ["q_proj", "v_proj"], True)] * 4
    assert [x.model.quantization for x in recipes] == ["none", "none", "8bit", "8bit"]  # 8bit: the recipe's base
    assert recipes[1].federation.strategy_args == {"svd": "randomized", "niter": 4, "residual": "auto"}


def test_checkpointing_settings_are_rows_of_their_own_with_the_same_losses(gpu_check, tmp_path, monkeypatch, capsys):
    """``--checkpointing true,2,false`` (the selective form a GPU session times against full checkpointing): one row
    per setting, each run with that ``train.gradient_checkpointing``; the losses are the same (checkpointing changes
    what is kept, not what is computed) and the dry-run estimate grows as fewer layers are checkpointed."""
    recipes = []
    real = gpu_check.recipe_for
    monkeypatch.setattr(gpu_check, "recipe_for", lambda *a, **k: recipes.append(real(*a, **k)) or recipes[-1])
    out = tmp_path / "check.json"
    assert gpu_check.main(["--dry", "--paper-7b", "--configs", "bf16", "--strategies", "fedavg", "--checkpointing",
                           "true,2,false", "--json", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["checkpointing"], "error" in r) for r in rows] == [(True, False), (2, False), (False, False)]
    assert [x.train.gradient_checkpointing for x in recipes] == [True, 2, False]
    assert rows[0]["losses"] == rows[1]["losses"] == rows[2]["losses"]
    assert rows[0]["memory_estimate"] < rows[1]["memory_estimate"] < rows[2]["memory_estimate"]
    table = capsys.readouterr().out.split("max |d|", 1)[1].splitlines()[1:4]
    assert [line.split()[4] for line in table] == ["True", "2", "False"]
    assert gpu_check.main(["--dry", "--checkpointing", "1"]) == 2
    assert "unknown checkpointing setting(s) ['1']" in capsys.readouterr().err


def _bench(name: str):
    return load_script(ROOT / "bench" / f"{name}.py")


def test_estimate_only_prints_a_gpu_rows_estimate_without_a_gpu_and_trains_nothing(gpu_check, tmp_path, capsys):
    """``--estimate-only --device cuda``: the dry run's estimate of each planned row for a GPU, on this CPU host (the
    paper's 7B shape from its config on the meta device, in seconds), equal to the cost report's own; with
    ``train.compile`` the estimate is the compiled layer's (less than eager's)."""
    from fedllm.commands.dry_run import untimed

    work = tmp_path / "work"
    assert gpu_check.main(["--device", "cuda", "--paper-7b", "--configs", "bf16", "--strategies", "fedavg",
                           "--compile", "false,true", "--estimate-only", "--work-dir", str(work)]) == 0
    printed = re.findall(r"gpu_check: estimate llama2-7b bf16 fedavg 16 x 512 compile=(\w+) checkpointing=True: "
                         r"([0-9.]+) GiB \(cuda\)", capsys.readouterr().out)
    assert [c for c, _ in printed] == ["False", "True"]
    eager, compiled = (float(gib) for _, gib in printed)
    assert compiled < eager
    recipe = gpu_check.recipe_for(work / "config-llama2-7b", work / "data-big.jsonl", work / "x", "fedavg", "bf16",
                                  "cuda", {**gpu_check.workload(gpu_check.parse_args(["--paper-7b"])),
                                           "compile": False, "checkpointing": True})
    costs = untimed(recipe, weights_missing="test").costs
    assert eager == round(sum(costs.memory("cuda").values()) / 2**30, 2)
    assert not any(p.name.startswith(("run-", "model-")) for p in work.iterdir())  # nothing trained, no weights


def test_profile_writes_the_last_rounds_host_ops_and_python_calls_and_stops(gpu_check, tmp_path, capsys):
    profile = tmp_path / "profile.txt"
    assert gpu_check.main(["--dry", "--models", "smollm2-135m", "--configs", "fp32", "--profile", str(profile),
                           "--work-dir", str(tmp_path / "work")]) == 0
    text = profile.read_text()
    assert text.startswith("round 2: 2 micro-batches in ")  # the last round, 2 clients x 1 step
    assert "aten::mm" in text and "Self CPU" in text  # torch.profiler's table
    assert "fedllm/engine/client.py" in text and "train_client" in text  # cProfile's, with fedllm's own calls
    assert capsys.readouterr().out.count("gpu_check: run ") == 1  # only the profiled run (fedavg), then it stops


def test_gpu_packing_on_a_cpu_finds_packed_losses_equal_to_padded_ones():
    rows = _bench("gpu_packing").equality("cpu", ["llama"], ["sdpa", "eager"])
    assert len(rows) == 8  # fp32 and bf16, sdpa and eager, one row and rows of 128
    for r in rows:
        if r["dtype"] == "fp32":
            assert r["max_loss_diff"] <= 1e-5 and r["max_grad_rel_diff"] <= 1e-5
        elif r["attention"] == "eager":  # bf16: the same kernels on the same positions
            assert r["max_loss_diff"] == 0


def test_gpu_step_times_each_variant_on_a_cpu(tmp_path):
    out = tmp_path / "step.json"
    assert _bench("gpu_step").main(["--device", "cpu", "--tiny", "--models", "smollm2-135m", "--shapes", "2x16",
                                    "--variants", "eager,fused-adamw", "--steps", "1", "--trials", "1",
                                    "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager", "fused-adamw"]
    assert all(r["seconds_per_step"] > 0 and math.isfinite(r["loss"]) for r in rows)
    assert rows[0]["loss"] == rows[1]["loss"]  # on a CPU both are foreach AdamW: the same step
