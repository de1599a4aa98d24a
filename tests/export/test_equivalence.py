"""Exports reloaded with plain transformers / peft in a fresh process reproduce the run's models."""

from __future__ import annotations

import json

import pytest
import torch
from exportkit import ALPHA, CASES, TRUNCATED_RANK, R
from safetensors.torch import load_file

ATOL = 1e-4


def test_the_reload_process_used_transformers_alone_for_merged_models(cases):
    meta = next(iter(cases.values())).meta
    assert (meta["leaked_before_peft"], meta["fedllm_imported"]) == ([], False)  # (the cards' snippets: apart)


@pytest.mark.parametrize("name", list(CASES))
def test_merged_model_gives_the_runs_logits(cases, name):
    case = cases[name]
    for key in case.keys:
        ref = case.ref(key)
        assert (ref - case.got("original", "global")).abs().max() > 1e-3, "the run learned nothing visible"
        assert torch.allclose(case.got("merged", key), ref, atol=ATOL, rtol=0), (name, key)
        assert case.reports[f"merged/{key}"]["max_logit_diff"] < ATOL


@pytest.mark.parametrize("name", list(CASES))
def test_exact_adapter_on_the_original_base_gives_the_runs_logits(cases, name):
    case = cases[name]
    for key in case.keys:
        report = case.reports[f"adapter/{key}"]
        assert report["exact"] and not report["truncated_layers"] and report["rel_error_max"] < 1e-5
        assert torch.allclose(case.got("adapter", key), case.ref(key), atol=ATOL, rtol=0), (name, key)
        config = json.loads((case.dirs[f"adapter/{key}"] / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == ("tiny-roberta" if name == "classifier" else "tiny-llama")


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec.get("truncate")])
def test_truncated_adapter_stays_within_its_reported_error(cases, name):
    case = cases[name]
    key = 0 if case.keys != ["global"] else "global"
    report = case.reports[f"truncated/{key}"]
    assert not report["exact"] and report["rank_max"] == TRUNCATED_RANK and report["exact_rank_max"] > TRUNCATED_RANK
    assert 0 < report["rel_error_max"] < 1
    # the logits move by exactly what the export measured and wrote into export.json / README.md
    moved = float((case.got("truncated", key, "probe") - case.ref(key, "probe")).abs().max())
    assert moved > ATOL and moved == pytest.approx(report["max_logit_diff"], rel=1e-3, abs=1e-6)
    assert f"{report['rel_error_max']:.6g}" in (case.dirs[f"truncated/{key}"] / "README.md").read_text()
    # each layer's reported error is the true relative error of the saved factors against the learned change
    merged = load_file(str(case.dirs[f"merged/{key}"] / "model.safetensors"))
    original = load_file(str(case.original / "model.safetensors"))
    factors = load_file(str(case.dirs[f"truncated/{key}"] / "adapter_model.safetensors"))
    config = json.loads((case.dirs[f"truncated/{key}"] / "adapter_config.json").read_text())
    for layer, facts in report["per_layer"].items():
        delta = merged[f"{layer}.weight"].double() - original[f"{layer}.weight"].double()
        b = factors[f"base_model.model.{layer}.lora_B.weight"].double()
        a = factors[f"base_model.model.{layer}.lora_A.weight"].double()
        rank = config["rank_pattern"].get(layer, config["r"])
        scale = config["alpha_pattern"].get(layer, config["lora_alpha"]) / rank
        error = float(torch.linalg.norm(delta - scale * b @ a) / torch.linalg.norm(delta))
        assert error == pytest.approx(facts["rel_error"], rel=1e-3, abs=1e-6), layer


@pytest.mark.parametrize("name", ["fedloru", "fedloru-keep", "mfedloru"])
def test_fedloru_merged_export_equals_the_stacked_adapter(cases, name):
    case = cases[name]
    report = case.reports["adapter/global"]
    # two accumulations (tau = 1, 2 rounds) and a freshly re-initialised adapter (zero product): rank r x 2
    assert report["methods"] == {"stack": report["layers"]} and report["rank_max"] == report["rank_min"] == 2 * R
    assert report["r"] == 2 * R and report["alpha"] == pytest.approx(2 * ALPHA)
    assert torch.allclose(case.got("adapter", "global"), case.got("merged", "global"), atol=ATOL, rtol=0)
    merged = load_file(str(case.dirs["merged/global"] / "model.safetensors"))
    original = load_file(str(case.original / "model.safetensors"))
    factors = load_file(str(case.dirs["adapter/global"] / "adapter_model.safetensors"))
    scale = report["alpha"] / report["r"]
    for layer in report["per_layer"]:
        delta = merged[f"{layer}.weight"].double() - original[f"{layer}.weight"].double()
        stacked = scale * (factors[f"base_model.model.{layer}.lora_B.weight"].double()
                           @ factors[f"base_model.model.{layer}.lora_A.weight"].double())
        assert torch.allclose(stacked, delta, atol=1e-6, rtol=0), layer


def test_frlora_v1_becomes_a_standard_lora_of_double_rank_and_alpha(cases):
    report = cases["frlora_v1"].reports["adapter/global"]
    assert report["rank_min"] == report["rank_max"] == 2 * R
    assert report["r"] == 2 * R and report["alpha"] == pytest.approx(2 * ALPHA)


def test_frlora_residual_accumulation_needs_more_than_the_adapter_rank(cases):
    for name in ("frlora", "frlora-dense", "frlora_v3"):
        report = cases[name].reports["adapter/global"]
        assert report["methods"] == {"svd": report["layers"]} and report["rank_max"] > 2 * R, name
    merged = [cases[n].got("merged", "global") for n in ("frlora", "frlora-dense")]
    assert torch.allclose(merged[0], merged[1], atol=ATOL, rtol=0)  # merged in place or kept dense: same model


def test_personalized_strategy_exports_one_model_per_client(cases):
    case = cases["pfedloru"]
    assert case.keys == [0, 1, 2]
    personal = [case.ref(c) for c in case.keys]
    assert (personal[0] - personal[1]).abs().max() > 1e-4  # the clients' private adapters differ
    for c in case.keys:
        assert case.dirs[f"merged/{c}"].name == f"client-{c:04d}"
        assert case.reports[f"adapter/{c}"]["client"] == c
    assert "client-0001/" in (case.dirs["merged/0"].parent / "README.md").read_text()


def test_classifier_export_carries_the_trained_head(cases):
    case = cases["classifier"]
    merged = load_file(str(case.dirs["merged/global"] / "model.safetensors"))
    original = load_file(str(case.original / "model.safetensors"))
    heads = [k for k in merged if k.startswith("classifier.")]
    assert heads and any(not torch.equal(merged[k], original[k]) for k in heads)
    factors = load_file(str(case.dirs["adapter/global"] / "adapter_model.safetensors"))
    assert any("classifier" in k for k in factors)
    config = json.loads((case.dirs["merged/global"] / "config.json").read_text())
    assert config["id2label"] == {"0": "0", "1": "1"}


def test_flexlora_adapter_stacks_the_last_rounds_pieces_exactly(cases):
    case = cases["flexlora"]
    last = json.loads((case.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    rank = sum([4, 2, 4][c] for c in last["clients"])  # the recipe's client_ranks, summed over the last round
    report = case.reports["adapter/global"]
    assert report["methods"] == {"stack": report["layers"]} and report["rank_max"] == report["rank_min"] == rank > R
    assert torch.allclose(case.got("adapter", "global"), case.got("merged", "global"), atol=ATOL, rtol=0)
