"""4-bit and 8-bit bases keep the embedding, the head and the residual stream in ``model.dtype``.

PEFT's ``prepare_model_for_kbit_training`` casts every non-quantised parameter to fp32 (the tied embedding/head and
the norms), which made the residual stream fp32 and a 4-bit run use more memory than bf16
(``fedllm.models.loading.prepare_kbit_base``; measured in docs/performance.md with ``bench/kbit_memory.py``).
"""

import pytest
import torch

from fedllm.models.loading import load_model
from fedllm.models.supervised_loss import base_of
from fedllm.recipe.schema import LoraConfig, ModelConfig


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny LLaMA preset saved as a local model (a preset built in code is not quantised by from_pretrained)."""
    from fedllm.models.loading import load_base_model, load_tokenizer

    directory = tmp_path_factory.mktemp("tiny-llama")
    cfg = ModelConfig(name="tiny-llama")
    tok = load_tokenizer(cfg)
    load_base_model(cfg, tok).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def residual_dtypes(model, tok) -> set:
    """The dtypes of every decoder layer's output (the residual stream) and the final norm's, in a training pass."""
    base = base_of(model)
    seen = []
    hooks = [m.register_forward_hook(lambda m, a, out: seen.append((out[0] if isinstance(out, tuple) else out).dtype))
             for m in [*base.model.layers, base.model.norm]]
    ids = tok("What is 2 + 3? 5", return_tensors="pt")
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**ids, labels=ids["input_ids"]).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert any(p.grad is not None for n, p in model.named_parameters() if "lora_B" in n)
    return set(seen)


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_kbit_base_keeps_embedding_head_and_residual_in_the_compute_dtype(bits, tiny_dir):
    lm = load_model(ModelConfig(name=str(tiny_dir), dtype="bf16", quantization=bits), LoraConfig(r=4))
    base = base_of(lm.model)
    linear = type(base.model.layers[0].mlp.down_proj).__name__
    assert linear == ("Linear4bit" if bits == "4bit" else "Linear8bitLt")  # the layers are quantised
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().weight.dtype == torch.bfloat16
    assert base.model.norm.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for n, p in base.named_parameters() if "lora_" not in n)  # the base is frozen
    assert residual_dtypes(lm.model, lm.tokenizer) == {torch.bfloat16}


def test_flowertune_4bit_keeps_peft_preparation(tiny_dir):
    """4bit-flowertune loads as FlowerTune's templates do: PEFT's preparation, non-quantised weights in fp32."""
    lm = load_model(ModelConfig(name=str(tiny_dir), dtype="bf16", quantization="4bit-flowertune"), LoraConfig(r=4))
    assert base_of(lm.model).get_input_embeddings().weight.dtype == torch.float32
