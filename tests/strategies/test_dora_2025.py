"""DoRA (``lora.use_dora``) with the 2025 strategies (HetLoRA, RoLoRA, LoRA-FAIR, FedSVD, Fed-SB): the last round
recomputed by hand in float64 from what the server sent and received — each layer ``m̄ ⊙ V / ‖V‖_c`` (Liu et al.
2024, Eq. 5) with ``V`` the direction of the factors the server ends the round with (LoRA-FAIR's refined ``B̄ + ΔB``,
FedSVD's refactorised pair, Fed-SB's ``B·R̄·A``, HetLoRA's zero-padded norm-weighted mean) and ``m̄`` the mean of the
uploaded magnitudes with the strategy's weights — and the exports: merged (transformers alone) and adapter (peft on
the original base) give the run's logits, and PEFT's ``merge_and_unload`` of the loaded adapter gives the merged
export's weights."""

import pytest
import torch
from strategy_helpers import (
    effective_weights,
    example_weights,
    make_raw,
    norm_weights,
    padded_mean,
    record_rounds,
    uniform_weights,
)

from fedllm.common.registry import strategies
from fedllm.engine.server import run
from fedllm.export import export
from fedllm.export.inference import model_from_checkpoint
from fedllm.recipe.checks import parse_recipe
from fedllm.strategies.lora_fair import refine_b
from fedllm.strategies.residual import adapter_layers

IDS = torch.tensor([[1, 60, 77, 267, 315, 303, 374, 278, 36]])


def dora_weight(v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """DoRA's weight ``m ⊙ V / ‖V‖_c`` (each output row of ``V`` scaled to norm ``m``), float64."""
    return m.double()[:, None] * v / v.norm(dim=1, keepdim=True)


def rolora_direction(layer, sent, updates, p, out):
    """Round 2 trains ``A`` with ``B`` frozen: ``V = W + s·B·Ā``; ``B`` never travels up."""
    assert all(layer.b_key not in u.state for u in updates)
    return layer.scale * sent[layer.b_key].double() @ padded_mean(layer.a_key, updates, p)


def lora_fair_direction(layer, sent, updates, p, out):
    """``V = W + s·(B̄ + ΔB)·Ā`` with ``ΔB`` of Eq. 8 solved from the uploads (the solver is replayed against its
    own oracle in test_lora_fair.py); the refinement moved ``B``."""
    b_bar, a_bar = padded_mean(layer.b_key, updates, p), padded_mean(layer.a_key, updates, p)
    delta = refine_b([u.state[layer.b_key] for u in updates], [u.state[layer.a_key] for u in updates], p, b_bar,
                     a_bar, 0.01, 50, 0.3)
    assert delta.abs().max() > 1e-6
    return layer.scale * (b_bar + delta) @ a_bar


def hetlora_direction(layer, sent, updates, p, out):
    """``V = W + s·B̄Ā``, the zero-padded norm-weighted mean of uploads of different ranks."""
    assert len({u.state[layer.a_key].shape[0] for u in updates}) == 2
    return layer.scale * padded_mean(layer.b_key, updates, p, layer.rank) @ padded_mean(layer.a_key, updates, p, layer.rank)


def fedsvd_direction(layer, sent, updates, p, out):
    """``V = W + s·B̄·A`` with the round's ``A``; the refactorised pair the server keeps has orthonormal rows in
    ``A`` (so it did change) and the same product."""
    a = out[layer.a_key].double()
    assert not torch.allclose(a, sent[layer.a_key].double(), atol=1e-3)
    assert torch.allclose(a @ a.mT, torch.eye(a.shape[0], dtype=a.dtype), atol=1e-5)
    return layer.scale * padded_mean(layer.b_key, updates, p) @ sent[layer.a_key].double()


def fed_sb_direction(layer, sent, updates, p, out):
    """``V = W + s·B·R̄·A``, ``B`` and ``A`` fixed (the global state's), ``R̄`` the mean of the uploaded ``R``."""
    latent = f"{layer.name}.fed_sb.weight"
    return layer.scale * sent[layer.b_key].double() @ padded_mean(latent, updates, p) @ sent[layer.a_key].double()


CASES = {
    "rolora": ({}, example_weights, rolora_direction),
    "lora_fair": ({}, example_weights, lora_fair_direction),
    "hetlora": ({"client_ranks": [4, 2, 1], "gamma": 1.0}, norm_weights, hetlora_direction),
    "fedsvd": ({}, example_weights, fedsvd_direction),
    "fed_sb": ({"init_samples": 8}, uniform_weights, fed_sb_direction),
}


@pytest.mark.parametrize("strategy", sorted(CASES))
def test_dora_2025_strategy_round_replays_in_float64_and_exports(strategy, data_files, tmp_path, monkeypatch):
    """Every layer of the checkpoint's model equals ``m̄ ⊙ V / ‖V‖_c`` recomputed from the last round's sent state and
    uploads (float64, 1e-5), the magnitudes trained differently on the clients; the merged export gives the run's
    logits and the oracle's weights, the adapter export gives the run's logits on the original base with peft and
    PEFT's ``merge_and_unload`` of it gives the merged export's weights."""
    args, weights, direction = CASES[strategy]
    rounds = record_rounds(monkeypatch, strategies.get(strategy))
    result = run(parse_recipe(make_raw(data_files, tmp_path / "run", strategy, args, lora={"use_dora": True})))
    rnd, sent, updates, out = rounds[-1]
    assert rnd == 2
    model, _, _, _ = model_from_checkpoint(result.run_dir)
    got, layers = effective_weights(model), adapter_layers(model)
    oracle = {}
    for name, layer in layers.items():
        assert layer.magnitude_key and all(layer.magnitude_key in u.state for u in updates)
        magnitudes = [u.state[layer.magnitude_key] for u in updates]
        assert not torch.equal(magnitudes[0], magnitudes[1])  # the clients trained m differently
        p = weights(layer, updates)
        v = layer.base.weight.double() + direction(layer, sent, updates, p, out)
        oracle[name] = dora_weight(v, padded_mean(layer.magnitude_key, updates, p))
        assert (got[name].double() - oracle[name]).abs().max() <= 1e-5, name
        assert (result.global_state[layer.magnitude_key].double() - oracle[name].norm(dim=1)).abs().max() <= 1e-5
    if strategy == "fed_sb":  # DoRA starts where LoRA-SB does: m = ‖W + s·B·R_0·A‖_c of the initialised factors
        first = rounds[0][1]
        for name, layer in layers.items():
            v0 = layer.base.weight.double() + layer.scale * first[layer.b_key].double() @ first[
                f"{name}.fed_sb.weight"].double() @ first[layer.a_key].double()
            assert (first[layer.magnitude_key].double() - v0.norm(dim=1)).abs().max() <= 1e-5
            assert (v0.norm(dim=1) - layer.base.weight.double().norm(dim=1)).abs().max() > 1e-5
    assert_exports(result.run_dir, tmp_path, model, oracle)


def assert_exports(run_dir, tmp_path, model, oracle):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    with torch.no_grad():
        run_logits = model.eval()(input_ids=IDS).logits
    merged = AutoModelForCausalLM.from_pretrained(str(export(run_dir, "merged", tmp_path / "merged").out)).eval()
    original = load_base_model(ModelConfig(name="tiny-llama"), load_tokenizer(ModelConfig(name="tiny-llama")),
                               num_labels=2, seed=0)
    loaded = PeftModel.from_pretrained(original, str(export(run_dir, "adapter", tmp_path / "adapter").out)).eval()
    with torch.no_grad():
        assert (merged(input_ids=IDS).logits - run_logits).abs().max() <= 1e-5
        assert (loaded(input_ids=IDS).logits - run_logits).abs().max() <= 1e-5
        peft_merged = loaded.merge_and_unload().state_dict()
    for name, weight in oracle.items():
        plain = merged.get_submodule(name.removeprefix("base_model.model.")).weight
        assert (plain.double() - weight).abs().max() <= 1e-5, name
    assert all((v - peft_merged[k]).abs().max() <= 1e-6 for k, v in merged.state_dict().items())
