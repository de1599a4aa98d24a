"""A FRLoRA run on a bf16 base keeps an fp32 dense residual per layer beside the base; its merged export must fit
where the run trained (issue #48 item 4: a 7B run's export was killed at 24.2 GB). The export reads the residuals from
the checkpoint one layer at a time, never runs FRLoRA's SVD init (the checkpoint replaces what it builds), casts no
whole model to fp32 and keeps the merged layers' fp32 weights on disk until the save, and its merged weights are
still the run's base + residual + adapter."""

from __future__ import annotations

import weakref

import pytest
import torch
from safetensors.torch import load_file

from fedllm.export import export
from fedllm.export.inference import model_from_checkpoint
from fedllm.runs import base_history
from fedllm.strategies import frlora
from tests.conftest import arith_records, tiny_raw, write_jsonl


@pytest.fixture(scope="module")
def bf16_frlora_run(tmp_path_factory):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    root = tmp_path_factory.mktemp("frlora")
    raw = tiny_raw(root / "run", write_jsonl(root / "arith.jsonl", arith_records(48)), model={"dtype": "bf16"},
                   federation={"rounds": 2, "strategy": "frlora", "strategy_args": {"residual": "auto"}},
                   train={"local_steps": 2})
    return run(parse_recipe(raw)).run_dir


def _track_residuals(monkeypatch) -> dict:
    """Count the residuals the export rebuilds from the checkpoint, and the most alive at once."""
    seen = {"live": [], "most_live": 0, "rebuilt": 0, "svd_inits": 0}
    rebuild = base_history.StoredHistory.rebuild

    def tracked(self, key, *args, **kwargs):
        value = rebuild(self, key, *args, **kwargs)
        if key.startswith("residual/"):
            seen["live"] = [ref for ref in seen["live"] if ref() is not None] + [weakref.ref(value)]
            seen["most_live"] = max(seen["most_live"], len(seen["live"]))
            seen["rebuilt"] += 1
        return value

    principal = frlora.principal_factors

    def counted(*args, **kwargs):
        seen["svd_inits"] += 1
        return principal(*args, **kwargs)

    monkeypatch.setattr(base_history.StoredHistory, "rebuild", tracked)
    monkeypatch.setattr(frlora, "principal_factors", counted)
    return seen


def test_the_merged_export_holds_one_residual_at_a_time_and_runs_no_svd_init(bf16_frlora_run, tmp_path, monkeypatch):
    seen = _track_residuals(monkeypatch)
    from fedllm.export import spill

    put = spill.SpilledWeights.put
    monkeypatch.setattr(spill.SpilledWeights, "put", lambda self, name, w: seen.setdefault("spilled", []).append(
        (name, w.dtype)) or put(self, name, w))
    facts = export(bf16_frlora_run, "merged", tmp_path / "merged", dtype="bf16").exports[0]
    layers = facts["layers"]
    assert layers == 8 and facts["checked"] and facts["merged_in"] is None  # q, v of 4 layers; fp32 probe check held
    assert seen["rebuilt"] >= layers  # every residual was read
    assert seen["most_live"] == 1  # ... one at a time (the eager restore holds all 8 at once)
    assert seen["svd_inits"] == 0  # the checkpoint supplies what FRLoRA's set-up would compute
    assert len(seen["spilled"]) == layers and {d for _, d in seen["spilled"]} == {torch.float32}  # fp32, on disk


def test_merged_weights_are_base_plus_residual_plus_adapter(bf16_frlora_run, tmp_path):
    """The fp32 export against the run's model as evaluation loads it (the eager restore, residuals held), summed
    independently in float64 and rounded once, bit for bit; the bf16 export is that fp32 export rounded, bit for bit.
    The fp32 merged layers kept on disk until the save (fedllm.export.spill) are gone."""
    export(bf16_frlora_run, "merged", tmp_path / "fp32", dtype="fp32")
    export(bf16_frlora_run, "merged", tmp_path / "bf16", dtype="bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bf16", "fp32"]
    assert not [p for p in tmp_path.rglob("*") if "merged-fp32" in p.name]
    got32 = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    got16 = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    model, _, strategy, _ = model_from_checkpoint(bf16_frlora_run)  # no read_once: every residual restored
    residuals = dict(strategy.base.residual)
    assert len(residuals) == 8 and all(r.dtype == torch.float32 for r in residuals.values())
    params = dict(model.named_parameters())
    seen = 0
    for name, module in model.named_modules():
        if name not in residuals:
            continue
        key = name.removeprefix("base_model.model.") + ".weight"
        base = module.base_layer.weight
        assert base.dtype == torch.bfloat16
        s = float(module.scaling["default"])
        adapter = s * (module.lora_B["default"].weight.double() @ module.lora_A["default"].weight.double())
        want = base.double() + (adapter + residuals[name].double())
        assert torch.equal(got32[key], want.float())  # the float64 sum in this order, rounded once
        assert torch.equal(got16[key], got32[key].to(torch.bfloat16))
        seen += 1
    assert seen == 8
    others = [key for key in got32 if f"base_model.model.{key}" in params]  # not LoRA-wrapped
    assert others
    for key in others:  # every other weight is the run's bf16 base, exactly
        run_value = params[f"base_model.model.{key}"]
        assert torch.equal(got32[key], run_value.float()) and torch.equal(got16[key], run_value), key


def _tensors(directory) -> dict:
    found = {}
    for path in sorted(directory.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def test_an_fp32_export_of_a_bf16_base_widens_one_shard_at_a_time(bf16_frlora_run, tmp_path, monkeypatch):
    """``--dtype fp32`` of a bf16 run: the saved files are what casting the whole model to fp32 and saving it writes
    (the export before this change, kept as the reference), but the model is never cast whole: it is saved in bf16
    in shards and each shard is widened on its own (a 7B base cast whole takes 27 GB)."""
    import json

    import transformers

    from fedllm.export import merged, widen

    monkeypatch.setattr(merged, "widens", lambda *a: False)  # the whole-model cast, as before
    export(bf16_frlora_run, "merged", tmp_path / "whole", dtype="fp32")
    monkeypatch.undo()

    monkeypatch.setattr(widen, "SHARD_BYTES", 64 * 1024)  # many shards at this size
    written, held = [], {}
    import safetensors.torch

    real_save = safetensors.torch.save_file

    def spy_save(tensors, *args, **kwargs):
        written.append(sum(t.numel() * t.element_size() for t in tensors.values()))
        return real_save(tensors, *args, **kwargs)

    real_widened = widen.save_widened

    def spy_widened(model, out, dtype):
        real_widened(model, out, dtype)
        held["dtypes"] = {p.dtype for p in model.parameters()}

    monkeypatch.setattr(safetensors.torch, "save_file", spy_save)
    monkeypatch.setattr(merged, "save_widened", spy_widened)
    export(bf16_frlora_run, "merged", tmp_path / "shards", dtype="fp32")

    whole, shards = _tensors(tmp_path / "whole"), _tensors(tmp_path / "shards")
    assert sorted(whole) == sorted(shards)
    assert all(torch.equal(whole[k], shards[k]) and shards[k].dtype == torch.float32 for k in whole)
    assert torch.bfloat16 in held["dtypes"]  # the model itself was not cast to fp32
    files = sorted(p.name for p in (tmp_path / "shards").glob("*.safetensors"))
    assert len(files) > 1 and len(written) == len(files)  # each shard widened and written on its own
    largest = max(t.numel() * 2 for t in whole.values())  # a tensor larger than a shard is a shard of its own
    assert max(written) <= 2 * max(widen.SHARD_BYTES, largest)
    index = json.loads((tmp_path / "shards" / widen.INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in whole.values())
    assert set(index["weight_map"].values()) == set(files)
    assert json.loads((tmp_path / "shards" / "config.json").read_text())["dtype"] == "float32"
    assert json.loads((tmp_path / "whole" / "config.json").read_text())["dtype"] == "float32"
    assert not [p for p in (tmp_path / "shards").iterdir() if p.name.endswith(".widening")]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "shards"), dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
