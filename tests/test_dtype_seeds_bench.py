"""bench/dtype_seeds.py: the run order, the commands, the comparison (hand-computed), bad options, and two tiny runs.

The bench's own measurement (the quickstart's six SmolLM2 runs) is in docs/performance.md; here a tiny LLaMA trains
one round per dtype, so that the bench's reading of real run directories is checked on what fedllm writes.
"""

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import arith_records, load_script, tiny_raw, write_jsonl

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    return load_script(ROOT / "bench" / "dtype_seeds.py")


def run(seed, dtype, after, losses, before=0.1):
    return {"seed": seed, "dtype": dtype, "metric": "gsm8k/accuracy", "resolved": {"train": "x", "model": "x"},
            "before": before, "after": after, "losses": losses, "wall_s": 10.0 * (seed + 1), "cpu_s": 5.0}


def test_each_seed_runs_in_every_dtype_before_the_next_seed(bench):
    assert bench.run_plan([0, 1, 2], ["auto", "fp32"]) == [(0, "auto"), (0, "fp32"), (1, "auto"), (1, "fp32"),
                                                           (2, "auto"), (2, "fp32")]


def test_fp32_runs_set_the_base_weights_to_fp32_too(bench):
    cmd = bench.train_command(Path("r.yaml"), 2, "fp32", Path("out"), 1, ["federation.rounds=1"])
    assert cmd[-6:] == ["seed=2", "output_dir=out/s2-fp32", "train.dtype=fp32", "model.dtype=fp32", "train.threads=1",
                        "federation.rounds=1"]
    assert "train.threads=1" not in bench.train_command(Path("r.yaml"), 0, "auto", Path("out"), None, [])


def test_comparison_against_fp32_by_hand(bench):
    fp32 = [run(0, "fp32", 0.5, [1.0, 0.5]), run(1, "fp32", 0.6, [1.2, 0.4]), run(2, "fp32", 0.7, [0.8, 0.3])]
    close = [run(0, "auto", 0.55, [1.1, 0.5]), run(1, "auto", 0.5, [1.2, 0.45]), run(2, "auto", 0.6, [0.8, 0.3])]
    c = bench.compare(fp32 + close)
    # fp32: mean 0.6, sample std sqrt(((-0.1)^2 + 0 + 0.1^2) / 2) = 0.1; auto: mean 0.55, gap -0.05
    assert c["dtypes"]["fp32"]["after"] == pytest.approx((0.6, 0.1))
    assert c["dtypes"]["fp32"]["losses"] == pytest.approx([1.0, 0.4])
    assert c["dtypes"]["auto"]["wall_s"] == pytest.approx(20.0)
    verdict = c["dtypes"]["auto"]["vs_fp32"]
    assert verdict["accuracy_gap"] == pytest.approx(-0.05)
    assert verdict["within_one_std"] is True
    assert verdict["max_loss_diff"] == pytest.approx(0.1)  # seed 0 round 1: 1.1 vs 1.0
    far = [run(s, "auto", 0.45, [1.0, 0.5]) for s in range(3)]  # gap -0.15 > 0.1
    assert bench.compare(fp32 + far)["dtypes"]["auto"]["vs_fp32"]["within_one_std"] is False
    text = bench.table(fp32 + far, bench.compare(fp32 + far))
    assert "| 0 | fp32 (x/x) | 0.1000 | 0.5000 | 1.0000 0.5000 | 10.0 | 5.0 |" in text
    assert "| fp32 | 0 1 2 | 0.1000 ± 0.0000 | 0.6000 ± 0.1000 | 1.0000 0.4000 | 20.0 | 5.0 |" in text
    assert "auto vs fp32: mean accuracy -0.1500, NOT within one fp32 standard deviation (0.1000)" in text


def test_without_fp32_there_is_no_verdict(bench):
    c = bench.compare([run(0, "auto", 0.5, [1.0])])
    assert c["dtypes"]["auto"]["after"] == (0.5, 0.0) and "vs_fp32" not in c["dtypes"]["auto"]


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--set", "seed"], ["--resume"], ["--seeds", "1", "1"],
                                  ["--dtypes", "fp16"], ["--recipe", "no-such.yaml"]])
def test_bad_options_exit_2(bench, argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_options(argv)
    assert e.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_two_tiny_runs_read_back_and_resume(bench, tmp_path, capsys):
    data = write_jsonl(tmp_path / "arith.jsonl", arith_records(48))
    raw = tiny_raw(tmp_path / "unused", data, federation={"rounds": 1}, data={"eval_fraction": 0.25},
                   eval={"before_training": True, "max_new_tokens": 4})
    del raw["train"]["dtype"]  # what the bench sets
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    argv = ["--recipe", str(recipe), "--seeds", "0", "--dtypes", "fp32", "bf16", "--threads", "1",
            "--out", str(tmp_path / "runs"), "--json", str(tmp_path / "runs.json")]
    assert bench.main(argv) == 0
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert [(r["dtype"], r["resolved"]["train"], r["resolved"]["model"]) for r in runs] == [
        ("fp32", "fp32", "fp32"), ("bf16", "bf16", "bf16")]
    for r in runs:
        assert r["metric"] == "held_out/answer_accuracy" and 0 <= r["before"] <= 1 and 0 <= r["after"] <= 1
        assert len(r["losses"]) == 1 and math.isfinite(r["losses"][0]) and r["cpu_s"] > 0
        metrics = (tmp_path / "runs" / f"s0-{r['dtype']}" / "metrics.jsonl").read_text().splitlines()
        assert r["losses"][0] == json.loads(metrics[1])["train_loss"]
    out = capsys.readouterr().out
    assert "bf16 vs fp32: mean accuracy" in out and "| 0 | bf16 (bf16/bf16) |" in out
    with pytest.raises(SystemExit, match="exists"):  # a run directory is never written over
        bench.main(argv)
    assert bench.main([*argv, "--resume"]) == 0  # both done: nothing runs, the same table
    assert "| 0 | fp32 (fp32/fp32) |" in capsys.readouterr().out


def test_repro_small_reads_a_bf16_layer_through_an_fp32_copy():
    """bench/repro_small.py --dtype bf16/auto: what a LoRA layer on a bf16 base computes, W0 + s·B·A, read in fp32
    (a bf16 output would round the change B·A to the weights' magnitude; an fp32 identity fed to the bf16 base was a
    dtype error), so the learned change keeps its rank r."""
    import sys

    import peft
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    try:
        repro = load_script(ROOT / "bench" / "repro_small.py")
    finally:
        sys.path.remove(str(ROOT / "bench"))
    from fedllm.models.lowrank import numerical_rank

    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("lin", torch.nn.Linear(16, 8))
    model = peft.get_peft_model(net, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["lin"],
                                                     init_lora_weights=False))
    layer = model.base_model.model.lin
    layer.base_layer.to(torch.bfloat16)
    (name, _), = repro.lora_layers(model).items()
    w = repro.layer_weights(model)[name]
    w0 = layer.base_layer.weight.float()
    delta = 2.0 * layer.lora_B["default"].weight @ layer.lora_A["default"].weight  # scaling alpha / r = 2
    assert w.dtype == torch.float32 and torch.allclose(w, w0 + delta, atol=1e-5)
    assert numerical_rank(w - w0, rtol=1e-3) == 2
    assert layer.base_layer.weight.dtype == torch.bfloat16  # the model itself is left as it was
