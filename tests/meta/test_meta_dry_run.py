"""``fedllm train RECIPE --dry-run`` without the weights (meta device) and without the data."""

import re
from pathlib import Path

import pytest
import yaml

from fedllm.commands.cli import main

RECIPE = "recipes/frlora/llama2-7b-alpaca-gpt4-frlora.yaml"


def test_dry_run_of_llama2_7b_frlora_offline(capsys, monkeypatch):
    from fedllm.models import cpu_half_matmul

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # the how-to's host: a CPU with a bf16 GEMM (without one, the estimate adds the fp32 blocks' 0.02 GB)
    monkeypatch.setattr(cpu_half_matmul, "native_half_gemm", lambda dtype: True)
    assert main(["train", RECIPE, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "built on the meta device from fedllm's shipped config" in out
    assert "16,777,216 trainable (exact), 6,738,415,616 frozen" in out
    assert "self_attn.q_proj             32      8,388,608      536,870,912" in out
    assert "self_attn.k_proj             32              0      536,870,912" in out
    assert "LoRA r=32 alpha=64 on 64 layers: q_proj x32, v_proj x32" in out
    assert "down 64.000 MB (67,108,864 B), up 64.000 MB (67,108,864 B)" in out
    assert "non-participating client per round: down 64.000 MB (67,108,864 B) (18 of 20 clients)" in out
    # FRLoRA on an 8-bit base keeps an fp32 residual per wrapped layer: 64 x 4096 x 4096 x 4 B, on every client
    assert "every client also keeps the base changes, 4,096.000 MB" in out
    assert "activations: what autograd saves in one traced layer" in out and "FRLoRA SVD init (randomized)" in out
    assert "fits: 24 GB / 40 GB / 80 GB GPU: " in out
    assert "not checked: step time" in out and "nothing was written to" in out
    # the cost how-to shows this report verbatim: the same lines but for the seconds the set-up took
    readme = Path("docs/how-to/estimate-cost.md").read_text(encoding="utf-8")
    shown = readme.split(f"$ HF_HUB_OFFLINE=1 fedllm train {RECIPE} --dry-run\n", 1)[1].split("```", 1)[0]
    seconds = re.compile(r"set up in [0-9.]+ s")
    assert seconds.sub("set up in S", shown) == seconds.sub("set up in S", out)


def test_dry_run_exits_2_naming_a_target_that_matches_nothing(tmp_path, capsys):
    with open(RECIPE) as f:
        raw = yaml.safe_load(f)
    raw["lora"]["target_modules"] = ["q_proj", "qkv_proj", "v_proj", "query"]
    raw["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "lora.target_modules: got 'qkv_proj'" in err and "lora.target_modules: got 'query'" in err
    assert "'q_proj'" not in err and "o_proj" in err  # the model's linear layers are listed
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("strategy", ["frlora", "fedex_lora"])
def test_cost_report_bytes_equal_a_real_rounds(tiny_recipe, strategy):
    """On a model that trains here, the report's bytes are those round 1 records in metrics.jsonl (FedEx-LoRA: its
    residual, sent to every client after the round, counted for every sampled client's factors)."""
    from fedllm.commands.dry_run import dry_run
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    raw = tiny_recipe(federation={"strategy": strategy, "num_clients": 4, "clients_per_round": 2, "rounds": 1,
                                  "partition": {"method": "iid"}})
    costs = dry_run(parse_recipe(raw)).costs
    first = run(parse_recipe(raw)).history[0]
    assert costs.comm.round_up == first["bytes_up_total"] and costs.comm.round_down == first["bytes_down_total"]
    assert {str(c): b for c, b in costs.comm.up.items()} == first["bytes_up"]
    # tiny LLaMA: 2 layers, hidden 64, 2 KV heads of 16; r = 4 on q, o (64 x 64) and k, v (32 x 64)
    assert costs.trainable == 2 * 4 * (2 * (64 + 64) + 2 * (32 + 64)) == 3584


@pytest.mark.parametrize("quantization,weights", [("none", 6_738_415_616 * 2), ("8bit", None)])
def test_peak_memory_weights_term(meta_costs, quantization, weights):
    report = meta_costs(RECIPE, f"model.quantization={quantization}", "train.gradient_checkpointing=false")
    mem = report.memory()
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)  # decoder linear weights: int8 + an fp32 scale per row
    rows = 32 * (4 * 4096 + 2 * 11008 + 4096)
    other = 6_738_415_616 - linear
    # 8-bit: the unquantised embedding, head and norms stay in model.dtype (bf16), 2 B each
    # (fedllm.models.loading.prepare_kbit_base; PEFT's preparation cast them to fp32, which docs/gpu.md measured)
    expected = weights if weights is not None else linear + 4 * rows + other * 2
    assert mem["weights"] == expected
    assert mem["optimizer"] == 2 * mem["trainable"] == 2 * 16_777_216 * 4
    tokens = 16 * 512
    layer = report.layer(report.device)  # traced (tests/meta/test_memory_estimate.py holds it against a real layer)
    # the head runs fused with its loss (frozen plain lm_head, supervised positions): one chunk of the logits, 32 MiB
    # of fp32 = 262 rows of LLaMA's 32,000 at 14 bytes a logit on a CPU in bf16 (12 on a GPU: no fp32 temporary in
    # the scatter; fedllm.models.fused_head_loss.chunk_peak_bytes_per_logit), plus the kept gradient with respect to
    # the hidden states
    chunk = 262 * 32000 * (14 if report.device == "cpu" else 12)
    assert mem["head"] == chunk + tokens * 4096 * 2
    # the chunk is freed before backward starts: backward counts only what one layer's gradients take beyond it
    assert mem["activations"] == 32 * layer.saved + layer.shared and mem["backward"] == layer.saved - chunk
    unfused = meta_costs(RECIPE, f"model.quantization={quantization}", "train.loss_positions=all").memory()
    assert unfused["head"] == tokens * 32000 * 10



def test_peak_memory_counts_the_base_changes_beside_a_quantised_base(meta_costs):
    """FRLoRA on an 8-bit base keeps its merges as an fp32 residual beside each wrapped weight (a forward hook adds
    it), in the training process too: 64 layers (q, v) x 4096 x 4096 x 4 B on top of the terms FedAvg's run has."""
    frlora = meta_costs(RECIPE, "model.quantization=8bit").memory()
    fedavg = meta_costs(RECIPE, "model.quantization=8bit", "federation.strategy=fedavg",
                        "federation.strategy_args={}").memory()
    assert frlora["base changes"] == 64 * 4096 * 4096 * 4 and fedavg["base changes"] == 0
    assert frlora["weights"] == fedavg["weights"] and frlora["activations"] == fedavg["activations"]

def test_dry_run_with_the_weights_but_without_the_data(tiny_recipe, tmp_path, capsys):
    """A real model whose data set is a hub id that cannot be loaded offline: the untimed report, saying so."""
    raw = tiny_recipe(data={"path": "nobody/no-such-dataset-offline", "max_examples": 60})
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["train", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "model (tiny-llama) loaded and strategy (fedavg) set up" in out and "tiny-llama (real weights)" in out
    assert "not checked: step time and the data set" in out
    assert "client sizes (taken as 20 examples each: data.max_examples / 3 clients)" in out
    assert "3,584 trainable (exact)" in out



def test_peak_memory_counts_both_answers_of_a_preference_pair(meta_costs):
    """A DPO batch of B pairs runs 2B sequences through the model (chosen, then rejected): the activation term
    doubles against the same recipe's SFT batch (with the full logits; fused, the head's chunk does not grow), the
    other terms stay."""
    sft = meta_costs(RECIPE, "train.loss_positions=all").memory()
    report = meta_costs(RECIPE, "data.format=preference", "train.objective=dpo", "data.fields={}",
                        "train.loss_positions=all")
    dpo = report.memory()
    assert dpo["head"] == 2 * sft["head"]
    # every per-row tensor a layer saves doubles; the few per-weight ones (autocast's casts of LoRA factors) do not
    assert dpo["activations"] == pytest.approx(2 * sft["activations"], rel=1e-3)
    fused_sft, fused_dpo = meta_costs(RECIPE).memory(), meta_costs(
        RECIPE, "data.format=preference", "train.objective=dpo", "data.fields={}").memory()
    chunk = 262 * 32000 * (14 if report.device == "cpu" else 12)  # one chunk of the fused head, the same for both
    assert fused_dpo["head"] - chunk == 2 * (fused_sft["head"] - chunk)
    assert "b=32 (2 x batch_size: a preference batch holds each pair's chosen and rejected answer)" in \
        "\n".join(report.lines())
    per_row = ("activations", "backward", "head", "residual casts")
    assert {k: v for k, v in dpo.items() if k not in per_row} == {k: v for k, v in sft.items() if k not in per_row}
