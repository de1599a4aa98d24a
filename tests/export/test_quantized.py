"""A 4-bit (QLoRA) run: the merged export is dequantized and merged in fp32; the adapter fits the 4-bit base."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("bitsandbytes")


def test_a_4bit_run_exports_a_plain_fp32_model_and_an_adapter(tiny_recipe, tmp_path):
    import transformers
    from peft import PeftModel

    from fedllm.engine.server import run
    from fedllm.export import export
    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.models.lowrank import dense_weight
    from fedllm.recipe.checks import parse_recipe
    from fedllm.recipe.schema import ModelConfig

    base_dir = tmp_path / "tiny-llama"
    tok = load_tokenizer(ModelConfig(name="tiny-llama"))
    load_base_model(ModelConfig(name="tiny-llama"), tok).save_pretrained(str(base_dir))
    tok.save_pretrained(str(base_dir))
    recipe = parse_recipe(tiny_recipe(model={"name": str(base_dir), "quantization": "4bit"},
                                      federation={"rounds": 1}, train={"local_steps": 1}))
    result = run(recipe)
    model = result.model.eval()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    expected = dense_weight(layer.get_base_layer()) + layer.scaling["default"] * (
        layer.lora_B["default"].weight.float() @ layer.lora_A["default"].weight.float())
    ids = torch.tensor([[1, 40, 50, 60, 70, 80, 90]])
    with torch.no_grad():
        reference = model(input_ids=ids).logits.float()

    merged = export(result.run_dir, "merged", tmp_path / "merged", dtype="fp32").exports[0]
    assert merged["dequantized_from"] == "4bit" and not merged["checked"]
    assert "quantization_config" not in json.loads((tmp_path / "merged" / "config.json").read_text())
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    weight = plain.model.layers[0].self_attn.q_proj.weight
    assert weight.dtype == torch.float32 and torch.allclose(weight, expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, reference, atol=2e-2, rtol=0)  # the run computed in bf16

    adapter = export(result.run_dir, "adapter", tmp_path / "adapter").exports[0]
    assert adapter["exact"] and adapter["methods"] == {"stack": adapter["layers"]}
    quantized_base = load_base_model(recipe.model, tok)
    loaded = PeftModel.from_pretrained(quantized_base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits.float(), reference, atol=1e-4, rtol=0)
