"""Model loading: presets, LoRA targets, rank checks, real shipped weights (slow)."""

import pytest
import torch

from fedllm.models.loading import (
    ModelError,
    load_base_model,
    load_model,
    load_tokenizer,
    lora_layers,
    trainable_state_keys,
)
from fedllm.recipe.schema import LoraConfig, ModelConfig, RecipeError


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-gemma"])
def test_decoder_presets_wrap_the_attention_projections(name):
    lm = load_model(ModelConfig(name=name), LoraConfig(r=4, alpha=8))
    assert lm.task == "causal_lm"
    wrapped = {n.rsplit(".", 1)[-1] for n in lora_layers(lm.model)}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj"}
    keys = trainable_state_keys(lm.model)
    assert keys and all("lora_" in k for k in keys)
    ids = lm.tokenizer("What is 2 + 3?", return_tensors="pt")
    out = lm.model(**ids, labels=ids["input_ids"])
    assert torch.isfinite(out.loss)


def test_roberta_preset_trains_attention_and_head():
    lm = load_model(ModelConfig(name="tiny-roberta"), LoraConfig(r=4), num_labels=3)
    assert lm.task == "classification"
    wrapped = {n.split("attention.", 1)[1] for n in lora_layers(lm.model)}
    assert wrapped == {"self.query", "self.key", "self.value", "output.dense"}
    keys = trainable_state_keys(lm.model)
    assert any("classifier.modules_to_save" in k for k in keys)
    assert lm.model(**lm.tokenizer("good", return_tensors="pt")).logits.shape == (1, 3)


def test_lora_init_is_seeded_and_b_starts_at_zero():
    a = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4), seed=3).model
    b = load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4), seed=3).model
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert all(torch.count_nonzero(v) == 0 for k, v in sa.items() if "lora_B" in k)


def test_impossible_rank_and_targets_are_recipe_errors():
    with pytest.raises(RecipeError, match=r"lora.r: got 100; expected <= min\(out, in\)"):
        load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=100))
    with pytest.raises(RecipeError, match="lora.target_modules"):
        load_model(ModelConfig(name="tiny-llama"), LoraConfig(r=4, target_modules=["no_such_proj"]))


def test_missing_model_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelError, match="GGUF file not found"):
        load_model(ModelConfig(name=str(tmp_path / "m.gguf")), LoraConfig())
    with pytest.raises(ModelError, match="directory not found"):
        load_model(ModelConfig(name=str(tmp_path / "nope")), LoraConfig())


def _save_base(name, directory):
    cfg = ModelConfig(name=name)
    tok = load_tokenizer(cfg)
    base = load_base_model(cfg, tok)
    base.save_pretrained(directory)
    tok.save_pretrained(directory)
    return base, tok


def test_local_directory_round_trip(tmp_path):
    base, tok = _save_base("tiny-qwen2", tmp_path / "m")
    again = load_model(ModelConfig(name=str(tmp_path / "m")), LoraConfig(r=2))
    assert again.model_type == "qwen2" and again.task == "causal_lm"
    ids = tok("What is 2 + 3?", return_tensors="pt")
    with torch.no_grad():  # LoRA starts as a no-op, so outputs equal the saved base's
        torch.testing.assert_close(again.model(**ids).logits, base(**ids).logits)


#: What bitsandbytes' Linear4bit layers carry (quant type, nested absmax, compute dtype) per ``model.quantization``:
#: QLoRA's config, and FlowerTune's templates' ``BitsAndBytesConfig(load_in_4bit=True)`` (bitsandbytes' defaults).
FOUR_BIT_LAYERS = {"4bit": ("nf4", True, torch.bfloat16), "4bit-flowertune": ("fp4", False, torch.float32)}


@pytest.mark.parametrize("bits", ["4bit", "4bit-flowertune", "8bit"])
def test_kbit_loading_through_bitsandbytes_trains(tmp_path, bits):
    _save_base("tiny-llama", tmp_path / "m")
    lm = load_model(ModelConfig(name=str(tmp_path / "m"), quantization=bits), LoraConfig(r=4))
    layer = next(iter(lora_layers(lm.model).values()))
    assert type(layer).__name__ == ("Linear8bitLt" if bits == "8bit" else "Linear4bit")
    if bits in FOUR_BIT_LAYERS:
        state = layer.weight.quant_state
        assert (state.quant_type, bool(state.nested), layer.compute_dtype) == FOUR_BIT_LAYERS[bits]
    ids = lm.tokenizer("What is 2 + 3?", return_tensors="pt")
    lm.model(**ids, labels=ids["input_ids"]).loss.backward()
    grads = [p.grad for n, p in lm.model.named_parameters() if "lora_A" in n]
    assert grads and all(g is not None for g in grads)


def test_bf16_dtype():
    lm = load_model(ModelConfig(name="tiny-llama", dtype="bf16"), LoraConfig(r=2))
    assert next(lm.model.get_base_model().parameters()).dtype == torch.bfloat16


@pytest.mark.slow
def test_real_minilm_encoder_as_classifier():
    lm = load_model(ModelConfig(name="minilm-l6"), LoraConfig(r=8), num_labels=4)
    assert lm.model_type == "bert" and lm.task == "classification" and len(lora_layers(lm.model)) == 4 * 6
    assert lm.model(**lm.tokenizer(["a", "b c"], return_tensors="pt", padding=True)).logits.shape == (2, 4)


def test_rank_check_after_load_reads_gpt2_conv1d_shapes(tmp_path):
    """GPT-2's attention is a transposed Conv1D (no out_features on the base layer): PEFT's wrapper gives them."""
    import transformers

    from fedllm.models.loading import attach_lora

    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100)
    assert len(lora_layers(attach_lora(transformers.GPT2LMHeadModel(config), LoraConfig(r=2, target_modules=["c_attn"]),
                                       "causal_lm"))) == 1
    with pytest.raises(RecipeError, match=r"lora.r: got 17; .*c_attn is \(48, 16\)"):
        attach_lora(transformers.GPT2LMHeadModel(config), LoraConfig(r=17, target_modules=["c_attn"]), "causal_lm")
