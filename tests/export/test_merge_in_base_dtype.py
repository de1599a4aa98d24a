"""A merged export of a bf16 base keeps its merged layers' fp32 weights on disk until the save (fedllm.export.spill);
when they do not fit there it merges each layer in fp32 and keeps the base's dtype: its bf16 files equal, bit for bit,
those of the fp32 path."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from fedllm.export import export, merged


def test_a_bf16_base_that_does_not_fit_as_fp32_exports_the_same_bf16_weights(tiny_recipe, tmp_path, monkeypatch,
                                                                             caplog):
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    recipe = parse_recipe(tiny_recipe(model={"dtype": "bf16"}, federation={"rounds": 1}, train={"local_steps": 2}))
    run_dir = run(recipe).run_dir
    roomy = export(run_dir, "merged", tmp_path / "roomy", dtype="bf16").exports[0]
    assert roomy["checked"] and roomy["merged_in"] is None

    monkeypatch.setattr(merged, "fits_on_disk", lambda directory, nbytes: False)  # no room for the fp32 layers
    short = export(run_dir, "merged", tmp_path / "short", dtype="bf16").exports[0]
    assert short["merged_in"] == "bfloat16" and not short["checked"]
    assert "the fp32 merged layers need" in caplog.text
    assert 0 < short["max_logit_diff"] < 0.1  # the bf16 model against the run's, reported
    a, b = load_file(str(tmp_path / "roomy" / "model.safetensors")), load_file(str(tmp_path / "short" / "model.safetensors"))
    assert a.keys() == b.keys() and any("q_proj" in k for k in a)
    assert all(b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in a)
    card = (tmp_path / "short" / "README.md").read_text()
    assert "stored in the base's bfloat16 (their fp32 weights did not fit on disk beside the export)" in card
    assert json.loads((tmp_path / "short" / "config.json").read_text())["model_type"] == "llama"
