"""4-bit and 8-bit bases keep the embedding, the head and the residual stream in ``model.dtype``.

PEFT's ``prepare_model_for_kbit_training`` casts every non-quantised parameter to fp32 (the tied embedding/head and
the norms), which made the residual stream fp32 and a 4-bit run use more memory than bf16
(``fedllm.models.loading.prepare_kbit_base``; measured in docs/performance.md with ``bench/kbit_memory.py``).
Neither do they keep the checkpoint file's pages or (8-bit) every quantised layer's input (``fedllm.models.kbit_memory``;
docs/memory.md).
"""

import pytest
import torch

from fedllm.models.loading import load_model
from fedllm.models.supervised_loss import base_of
from fedllm.recipe.schema import LoraConfig, ModelConfig


def _saved(tmp_path_factory, dtype: str):
    from fedllm.models.loading import load_base_model, load_tokenizer

    directory = tmp_path_factory.mktemp(f"tiny-llama-{dtype}")
    cfg = ModelConfig(name="tiny-llama", dtype=dtype)
    tok = load_tokenizer(cfg)
    load_base_model(cfg, tok).save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny LLaMA preset saved as a local model (a preset built in code is not quantised by from_pretrained)."""
    return _saved(tmp_path_factory, "fp32")


@pytest.fixture(scope="module")
def tiny_bf16_dir(tmp_path_factory):
    """The same saved in bf16, as most hub checkpoints are: a bf16 load maps its tensors instead of copying them."""
    return _saved(tmp_path_factory, "bf16")


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


def _file_mappings(directory) -> list[tuple[int, int]]:
    """Address ranges this process maps from files under ``directory`` (``/proc/self/maps``)."""
    ranges = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) >= 6 and fields[5].startswith(str(directory)):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.parametrize("bits", ["4bit", "8bit"])
def test_kbit_base_holds_no_view_of_the_checkpoint_file(bits, tiny_bf16_dir):
    """bitsandbytes reads every linear layer's weights through the loader's mapping of the file to quantise them;
    an unquantised parameter left as a view into that mapping kept the whole file resident beside the quantised
    weights (SmolLM2: 270 MiB of file pages, more than the bf16 base takes)."""
    import gc
    from pathlib import Path

    if not Path("/proc/self/maps").is_file():
        pytest.skip("needs /proc/self/maps")
    lm = load_model(ModelConfig(name=str(tiny_bf16_dir), dtype="bf16", quantization=bits), LoraConfig(r=4))
    gc.collect()
    mapped = _file_mappings(tiny_bf16_dir.resolve())
    tensors = [*lm.model.named_parameters(), *lm.model.named_buffers()]
    inside = [n for n, t in tensors if any(a <= t.data_ptr() < b for a, b in mapped)]
    assert inside == []
    # and the bf16 base does read its weights from the mapping (what the check above would miss if it did not)
    plain = load_model(ModelConfig(name=str(tiny_bf16_dir), dtype="bf16"), LoraConfig(r=4))
    mapped = _file_mappings(tiny_bf16_dir.resolve())
    assert any(a <= p.data_ptr() < b for p in plain.model.parameters() for a, b in mapped)
    assert base_of(lm.model).get_input_embeddings().weight is base_of(lm.model).get_output_embeddings().weight \
        or not base_of(lm.model).config.tie_word_embeddings  # tied weights stay one parameter


def test_8bit_layer_keeps_no_input_and_matches_bitsandbytes(tiny_dir):
    """bitsandbytes' LLM.int8() matmul stored its input on the autograd context although the input's gradient
    needs only the frozen weight; the 8-bit base's layers keep nothing of it, with bitsandbytes' output and input
    gradient bit for bit."""
    import gc
    import weakref

    from fedllm.models.loading import lora_layers

    lm = load_model(ModelConfig(name=str(tiny_dir), dtype="bf16", quantization="8bit"), LoraConfig(r=4))
    lm.model.train()
    layer = base_of(lm.model).model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(0)).bfloat16()
    x.requires_grad_(True)

    def output_and_input_grad(forward):
        x.grad = None
        out = forward(x * 1)  # a non-leaf input, as a decoder layer's activations are
        out.float().square().sum().backward()
        return out.detach(), x.grad.clone()

    ours = output_and_input_grad(layer)
    theirs = output_and_input_grad(lambda h: type(layer).forward(layer, h))  # bitsandbytes' own forward
    assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    hidden = x * 1
    out = layer(hidden)
    kept = weakref.ref(hidden)
    del hidden
    gc.collect()
    assert kept() is None  # the graph of `out` holds no reference to the layer's input
    out.sum().backward()
    assert len(lora_layers(lm.model)) > 0
