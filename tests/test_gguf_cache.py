"""A GGUF is converted once: later loads read the kept conversion, equal bit for bit (slow: real SmolLM2)."""

import pytest
import torch
import transformers

from fedllm.models import gguf_cache
from fedllm.models.loading import load_base_model, load_model, load_tokenizer, lora_layers
from fedllm.recipe.schema import LoraConfig, ModelConfig
from tests.conftest import tensor_digests

CHAT = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.mark.slow
def test_a_gguf_is_converted_once_and_read_back_bit_for_bit(smollm2_first_load, monkeypatch):
    first = smollm2_first_load  # the session's first load: converted from the GGUF, kept in first.cache
    assert first.sources == [first.gguf]
    assert len(first.parses) == 1  # tokenizer, config and weights read from one parse (one_parse_per_file)
    monkeypatch.setenv("FEDLLM_CACHE_DIR", first.cache)
    kept_model, kept_tok = (gguf_cache.model_dir(first.directory, first.gguf),
                            gguf_cache.tokenizer_dir(first.directory, first.gguf))
    assert kept_model and kept_tok and first.cache in kept_model
    sources = []  # what transformers was asked to read, load by load
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, name, *args, **kwargs):
        sources.append(kwargs.get("gguf_file") or name)
        return original(cls, name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    cfg, converted_tok = first.cfg, first.tokenizer
    tok = load_tokenizer(cfg)
    model = load_base_model(cfg, tok)
    assert sources == [kept_model]

    assert tensor_digests(model) == first.digests  # every tensor, its dtype and its bits
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # still tied
    assert model.generation_config.to_dict() == first.generation_config
    assert tok.get_vocab() == converted_tok.get_vocab() and tok.pad_token == converted_tok.pad_token
    text = converted_tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == text
    assert tok(text)["input_ids"] == converted_tok(text)["input_ids"]

    half = load_base_model(ModelConfig(name=cfg.name, dtype="bf16"), tok)  # other dtypes are cast from the copy
    assert sources[-1] == kept_model
    want = model.state_dict()
    assert all(torch.equal(v, want[k].to(torch.bfloat16)) for k, v in half.state_dict().items())
    del half, want

    lm = load_model(cfg, LoraConfig(r=8, alpha=16))  # the real model, from the kept copy, answers as itself
    assert lm.model_type == "llama" and len(lora_layers(lm.model)) == 4 * 30
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        nxt = lm.model(**ids).logits[0, -1].argmax()
    assert "Paris" in lm.tokenizer.decode(nxt)


def test_a_conversion_builds_each_gguf_tensor_name_map_once_with_the_same_mapping(monkeypatch):
    """transformers' GGUF weight map rebuilds gguf's ``TensorNameMap`` for every submodule it walks; fedllm's
    conversions (:func:`gguf_cache.tensor_name_maps_once`) build it once and map every tensor as before."""
    gguf = pytest.importorskip("gguf")
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    built = []
    real = gguf.get_tensor_name_map

    def counted(arch, n_blocks):
        built.append((arch, n_blocks))
        return real(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counted)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    plain = get_gguf_hf_weights_map(model, TensorProcessor())
    walked, built[:] = len(built), []
    with gguf_cache.tensor_name_maps_once():
        once = get_gguf_hf_weights_map(model, TensorProcessor())
    assert once == plain and {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight"} <= set(once.values())
    assert walked == len(list(model.modules())) > 10 and built == [(gguf.MODEL_ARCH.LLAMA, 2)]
    assert gguf.get_tensor_name_map is counted  # restored


@pytest.mark.slow
def test_a_gguf_preset_loads_quantised_from_its_conversion(smollm2_first_load, monkeypatch):
    """transformers quantises no GGUF file (it refuses a BitsAndBytesConfig beside one): a 4-bit load of a GGUF preset
    quantises the kept fp32 conversion, and the quantised real model still answers as itself."""
    from fedllm.models.supervised_loss import base_of

    first = smollm2_first_load
    monkeypatch.setenv("FEDLLM_CACHE_DIR", first.cache)
    kept_model = gguf_cache.model_dir(first.directory, first.gguf)
    sources = []
    original = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, name, *args, **kwargs):
        sources.append((kwargs.get("gguf_file") or name, type(kwargs.get("quantization_config")).__name__))
        return original(cls, name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    lm = load_model(ModelConfig(name=first.cfg.name, dtype="bf16", quantization="4bit"), LoraConfig(r=8, alpha=16))
    assert sources == [(kept_model, "BitsAndBytesConfig")]
    base = base_of(lm.model)
    assert type(base.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    ids = lm.tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        nxt = lm.model(**ids).logits[0, -1].argmax()
    assert "Paris" in lm.tokenizer.decode(nxt)


def test_one_parse_per_file_hands_a_files_first_parse_to_its_later_reads_until_the_scope_closes(tmp_path,
                                                                                               monkeypatch):
    """Inside :func:`gguf_cache.one_parse_per_file` a file is parsed once, a changed or another file anew; nested
    scopes share the parses; after the outermost scope gguf's reader is restored and nothing is kept."""
    gguf = pytest.importorskip("gguf")

    class Reader:
        made = []

        def __init__(self, path, mode="r"):
            self.path, self.mode = path, mode
            Reader.made.append((str(path), mode))

    monkeypatch.setattr(gguf, "GGUFReader", Reader)
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"a"), b.write_bytes(b"b")
    with gguf_cache.one_parse_per_file():
        first = gguf.GGUFReader(a)
        with gguf_cache.one_parse_per_file():
            assert gguf.GGUFReader(str(a)) is first and gguf.GGUFReader(b) is not first
        assert gguf.GGUFReader(a) is first  # the inner scope's end keeps the outer one's parses
        assert gguf.GGUFReader(a, "r+") is not first  # another mode is another reader
        a.write_bytes(b"changed")
        assert gguf.GGUFReader(a) is not first  # a changed file is parsed again
    assert Reader.made == [(str(a), "r"), (str(b), "r"), (str(a), "r+"), (str(a), "r")]
    assert gguf.GGUFReader is Reader and gguf_cache._parsed == {}
    assert gguf.GGUFReader(a) is not gguf.GGUFReader(a)  # outside any scope: gguf's own reader, a parse a read
