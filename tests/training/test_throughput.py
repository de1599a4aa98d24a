"""Throughput and MFU in every run: FLOPs from the model's shapes (by hand and against torch's FLOP counter),
the device peak (spec sheet, cached CPU probe), the round record, the round line and summary.json."""

import json

import pytest
import torch

from fedllm.models import hardware
from fedllm.models.flops import FlopShapes, TrainedWork, step_flops

#: A LLaMA small enough to count by hand: 2 layers, h=8, 2 heads of 4 (d_q=8), 1 KV head (d_kv=4), MLP 16, V=32.
TINY = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 4, "intermediate_size": 16, "vocab_size": 32}


def test_flops_of_a_tiny_config_by_hand():
    s = FlopShapes.of(TINY, 2, ["q_proj", "v_proj"])
    # q 8x8, k 4x8, v 4x8, o 8x8, gate 16x8, up 16x8, down 8x16
    assert s.linear == 64 + 32 + 32 + 64 + 128 + 128 + 128 == 576
    assert s.lora == 2 * (8 + 8) + 2 * (8 + 4) == 56  # r·(in + out) on q and v
    assert (s.first_in, s.first_lora_in) == (64 + 32 + 32, 2 * 8 + 2 * 8)
    assert s.q_dim == 8 and s.weights == ((4, 8), (8, 8), (8, 16), (16, 8))
    # b=3 rows of S=5 positions (T=15), head at 4 supervised positions:
    # dense: (2 layers·(4·576 + 6·56) − 2·128 − 2·32)·15 = (5280 − 320)·15 = 74,400
    # attention: (2 layers · 12 − 2, layer 0 needs no gradient of k: k_proj is not wrapped) · b·S² · d_q
    #   = 22·75·8 = 13,200; head: 4·V·h·4 = 4·32·8·4 = 4,096
    assert s.first_attention_grads == 3  # of the scores, q and v
    assert step_flops(s, 3, 5, 4) == 74_400 + 13_200 + 4_096
    # FRLoRA's dense residual: one more frozen product per target layer, (2·4·(64 + 32) − 2·96)·15 = 8,640
    assert step_flops(s, 3, 5, 4, residual=True) - step_flops(s, 3, 5, 4) == 8_640


def test_flops_of_the_smollm2_shape():
    from fedllm.models.info import CONFIGS_DIR

    config = json.loads((CONFIGS_DIR / "smollm2-135m-instruct" / "config.json").read_text())
    s = FlopShapes.of(config, 8, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert s.linear == 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536  # q, o; k, v; gate, up, down
    assert s.q_dim == 576 and s.vocab == 49152 and s.layers == 30
    plain = step_flops(s, 8, 128, 0)
    assert step_flops(s, 8, 128, 10) - plain == 4 * 49152 * 576 * 10  # the head at 10 positions


def _tiny_peft_model():
    import peft
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    model = transformers.AutoModelForCausalLM.from_config(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))


def test_flops_of_a_batch_equal_torch_flop_counter():
    """The formula against ``torch.utils.flop_counter`` on a real forward + backward of a ragged batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fedllm.engine.client import micro_batch_loss
    from fedllm.recipe.schema import TrainConfig

    model = _tiny_peft_model()
    model.train()
    ids = torch.randint(1, 32, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 5:] = 0  # a padded row
    labels = ids.clone()
    labels[:, :3] = -100  # prompt positions
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for positions in ("supervised", "all"):  # (the head at 10 positions or at all 21)
        cfg = TrainConfig(loss_positions=positions)
        work = TrainedWork()
        work.add_batch(batch, head_everywhere=positions == "all")
        assert (work.positions, work.square, work.tokens) == (21, 3 * 49, 19)
        assert work.supervised == int((labels[:, 1:] != -100).sum()) == 10
        counter = FlopCounterMode(display=False)
        with sdpa_kernel(SDPBackend.MATH), counter:
            micro_batch_loss(model, batch, cfg).backward()
        model.zero_grad(set_to_none=True)
        shapes = FlopShapes.of(TINY, 2, ["q_proj", "v_proj"])
        assert work.flops(shapes) == pytest.approx(counter.get_total_flops(), rel=1e-9), positions


def test_mfu_spec_peaks_of_known_gpus():
    assert hardware.spec_peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert hardware.spec_peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert hardware.spec_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert hardware.spec_peak("NVIDIA A10G", "bf16") == 70e12  # not the A10's figure
    assert hardware.spec_peak("Some Future GPU", "bf16") is None


def test_mfu_cpu_peak_is_probed_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path))
    calls = []

    def probe(weights, tokens, dtype, seconds=0.0):
        calls.append((tuple(weights), tokens, dtype))
        return 5e9, 2.5e9

    monkeypatch.setattr(hardware, "probe", probe)
    cpu = torch.device("cpu")
    first = hardware.device_peak(cpu, "fp32", [(8, 8), (16, 8)], 64)
    again = hardware.device_peak(cpu, "fp32", [(16, 8), (8, 8)], 64)
    assert calls == [(((8, 8), (16, 8)), 64, "fp32")]  # measured once, read back the second time
    assert (first.flops_per_s, first.flops_per_cpu_s) == (again.flops_per_s, again.flops_per_cpu_s) == (5e9, 2.5e9)
    hardware.device_peak(cpu, "bf16", [(8, 8), (16, 8)], 64)  # another dtype: its own probe
    assert len(calls) == 2 and (tmp_path / hardware.CACHE_FILE).exists()


def test_mfu_probe_measures_real_matmuls():
    rate, per_cpu = hardware.probe([(64, 64)], 64, "fp32", seconds=0.01)
    assert rate > 1e6 and per_cpu > 1e6  # any machine multiplies 64x64 matrices faster than a MFLOP/s


def test_throughput_in_round_record_round_line_and_summary(tiny_recipe, tmp_path, monkeypatch, caplog):
    """tokens/s, FLOPs per step, achieved FLOP/s and MFU in metrics.jsonl, the round line and summary.json."""
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "probe", lambda weights, tokens, dtype, seconds=0.0: (4e9, 2e9))
    said = []
    monkeypatch.setattr("fedllm.engine.server.RoundLoop.say", lambda self, line: said.append(line))
    result = run(parse_recipe(tiny_recipe(train={"dtype": "fp32"})))
    lines = [json.loads(x) for x in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    config = result.model.get_base_model().config.to_dict()
    shapes = FlopShapes.of(config, 4, None)
    for rec in lines:
        t = rec["throughput"]
        steps = sum(rec["client_steps"].values())
        assert t["micro_batches"] == steps == 4  # 2 clients x 2 steps x grad_accum 1
        assert t["positions"] * (1 - rec["padded_fraction"]) == pytest.approx(t["tokens"])
        assert 0 < t["supervised_tokens"] < t["tokens"]
        assert t["tokens_per_s"] == pytest.approx(t["tokens"] / t["train_seconds"], rel=1e-3)
        assert t["flops_per_step"] == pytest.approx(t["flops"] / steps)
        assert t["flops"] > shapes.flops(t["positions"], 0, 0)  # dense part alone is a lower bound
        assert t["mfu"] == pytest.approx(t["flops_per_s"] / 4e9)
        assert t["mfu_cpu"] == pytest.approx(t["flops_per_cpu_s"] / 2e9)
    round_lines = [x for x in said if x.startswith("round ")]
    assert len(round_lines) == 2 and all("tok/s=" in x and "MFU=" in x for x in round_lines)
    summary = json.loads((result.run_dir / "summary.json").read_text())["throughput"]
    assert summary["tokens"] == sum(x["throughput"]["tokens"] for x in lines)
    assert summary["flops"] == pytest.approx(sum(x["throughput"]["flops"] for x in lines))
    assert summary["mfu"] == pytest.approx(summary["flops_per_s"] / 4e9)
    assert summary["compute_dtype"] == "fp32" and summary["peak"]["flops_per_s"] == 4e9
    assert summary["peak"]["source"].startswith("probe: ")


def test_dry_run_prints_throughput_flops_per_step_and_mfu(tiny_recipe, tmp_path, monkeypatch):
    """``--dry-run`` (timed) prints the timed steps' tokens/s, FLOPs per step and MFU; the untimed report (no weights:
    meta device) the full-length FLOPs per step, hand-checked against the formula."""
    from fedllm.commands.dry_run import dry_run, untimed
    from fedllm.engine.throughput import model_shapes
    from fedllm.models.loading import load_model
    from fedllm.recipe.checks import parse_recipe

    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hardware, "probe", lambda weights, tokens, dtype, seconds=0.0: (4e9, 2e9))
    recipe = parse_recipe(tiny_recipe(train={"dtype": "fp32", "grad_accum": 2}))
    text = dry_run(recipe).report()
    line = next(x for x in text.splitlines() if x.startswith("  throughput of those steps: "))
    assert "tokens/s" in line and "GFLOP per step" in line and "MFU " in line and "fp32 peak 4.0 GFLOP/s" in line
    meta = untimed(recipe, weights_missing="test").report()
    shapes = model_shapes(load_model(recipe.model, recipe.lora, 2, 0, "t").model, recipe, "causal_lm")
    rows, s = 4 * 2, 64  # batch 4 x grad_accum 2, max_length 64
    expected = shapes.flops(rows * s, rows * s * s, rows * s)
    assert f"FLOPs per optimizer step: {expected / 1e9:,.3f} GFLOP at most (8 rows x max_length 64" in meta


def test_mfu_peak_of_a_probe_taken_on_a_busy_machine_counts_cpu_seconds(tmp_path, monkeypatch):
    """A probe whose wall rate was held down by other jobs: the peak is its rate per CPU-second x the threads."""
    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "probe", lambda weights, tokens, dtype, seconds=0.0: (1e9, 3e9))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    peak = hardware.device_peak(torch.device("cpu"), "bf16", [(8, 8)], 16)
    assert peak.flops_per_s == 6e9 and peak.flops_per_cpu_s == 3e9
