"""Regression: GGUF-read models count as quantized to transformers, whose .float() then refuses."""

import pytest
import torch

from fedllm.export.source import to_fp32
from fedllm.models.loading import load_base_model, load_tokenizer
from fedllm.recipe.schema import ModelConfig


def test_to_fp32_leaves_an_fp32_model_marked_quantized_alone_and_casts_half_models():
    cfg = ModelConfig(name="tiny-llama")
    model = load_base_model(cfg, load_tokenizer(cfg))
    model.is_quantized = True  # what transformers records for a model read from a GGUF file
    with pytest.raises(ValueError, match="quantized"):
        model.float()
    assert to_fp32(model) is model
    half = load_base_model(ModelConfig(name="tiny-llama", dtype="bf16"), load_tokenizer(cfg))
    assert all(p.dtype == torch.float32 for p in to_fp32(half).parameters())
