"""Shipped configs: every model a shipped recipe names builds on the meta device at its published size."""

import glob

import pytest
import yaml

from fedllm.recipe.schema import LoraConfig, ModelConfig

#: Published parameter counts (model cards / the models' papers; gemma3-270m: the GGUF loaded in transformers).
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,
    "mistralai/Mistral-7B-v0.3": 7_248_023_552,
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,  # v0.3 less its 768 extra vocabulary rows in embedding and head
    "Qwen/Qwen2-0.5B": 494_032_768,
    "Qwen/Qwen2-1.5B": 1_543_714_304,
    "google/gemma-2b": 2_506_172_416,
    "gemma3-270m": 268_098_176,
    "smollm2-135m-instruct": 134_515_008,
}
BUILT_FROM_CODE = ("tiny-llama", "tiny-qwen2", "tiny-gemma", "tiny-roberta")  # presets built from configs in code


def recipe_models():
    names = set()
    for path in glob.glob("recipes/*/*.yaml"):
        with open(path) as f:
            names.add(yaml.safe_load(f)["model"]["name"])
    return sorted(names - set(BUILT_FROM_CODE))


def test_every_recipe_model_has_a_shipped_config():
    from fedllm.models.info import shipped_config_dir

    names = recipe_models()
    assert {"meta-llama/Llama-2-7b-hf", "Qwen/Qwen2-0.5B", "google/gemma-2b", "FacebookAI/roberta-base"} <= set(names)
    assert [n for n in names if shipped_config_dir(n) is None] == []


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_meta_model_has_the_published_size(name):
    import torch

    from fedllm.models.info import meta_base_model

    model, task = meta_base_model(ModelConfig(name=name, dtype="bf16"))
    assert task == "causal_lm"
    params = list(model.parameters())
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    assert sum(p.numel() for p in {id(p): p for p in params}.values()) == PUBLISHED[name]


def test_roberta_base_encoder_size_and_classifier_task():
    from fedllm.models.info import meta_base_model

    model, task = meta_base_model(ModelConfig(name="FacebookAI/roberta-base"), num_labels=3)
    assert task == "classification" and model.config.num_labels == 3
    assert sum(p.numel() for p in model.roberta.parameters()) == 124_645_632 - 768 * 768 - 768  # published, less the pooler


def test_target_shapes_from_the_config_alone():
    from fedllm.models.meta import meta_target_shapes

    shapes = meta_target_shapes(ModelConfig(name="Qwen/Qwen2-0.5B"), LoraConfig(r=8, target_modules=["k_proj", "o_proj"]))
    assert len(shapes) == 48
    assert shapes["base_model.model.model.layers.0.self_attn.k_proj"] == (128, 896)  # 2 KV heads of 64
    assert shapes["base_model.model.model.layers.23.self_attn.o_proj"] == (896, 896)
    gemma = meta_target_shapes(ModelConfig(name="gemma3-270m"), LoraConfig(r=4))  # default targets: q, k, v, o
    assert gemma["base_model.model.model.layers.0.self_attn.q_proj"] == (1024, 640)  # 4 heads of 256 > hidden 640
    assert len(gemma) == 18 * 4
    tiny = meta_target_shapes(ModelConfig(name="tiny-llama"), LoraConfig(r=2, target_modules=["k_proj"]))
    assert set(tiny.values()) == {(32, 64)} and len(tiny) == 2  # tiny presets build their config in code


def test_weights_unavailable_offline(monkeypatch):
    from fedllm.models.info import weights_unavailable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert "HF_HUB_OFFLINE" in weights_unavailable(ModelConfig(name="meta-llama/Llama-2-7b-hf"))
    assert weights_unavailable(ModelConfig(name="tiny-llama")) is None
    assert weights_unavailable(ModelConfig(name="/no/such/dir")) == "directory not found"
