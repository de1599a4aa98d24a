"""Tokenized-data cache: round trip, keys, and a second run / --resume that tokenizes nothing."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedllm.data.token_cache import TokenCache, entry_key, open_token_cache, source_fingerprint
from fedllm.engine.server import run
from fedllm.models.loading import tiny_tokenizer
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import DataConfig


def test_round_trip_keeps_examples_dropped_records_and_scalars(tmp_path):
    calls = []

    def encode(record):
        calls.append(record["t"])
        if record["t"] == "drop":
            return None
        return {"input_ids": [len(record["t"]), 7, 8], "labels": [-100, 7, 8], "label": 3}

    records = [{"t": "ab"}, {"t": "drop"}, {"t": "xyz"}, {"t": "ab"}]
    first = TokenCache(tmp_path / "e.npz")
    wrapped = first.wrap(encode)
    out = [wrapped(r) for r in records]
    assert calls == ["ab", "drop", "xyz"]  # the repeated record is encoded once
    first.save()
    second = TokenCache(tmp_path / "e.npz")
    again = [second.wrap(encode)(r) for r in records]
    assert calls == ["ab", "drop", "xyz"] and again == out
    assert out[1] is None and out[0] == {"input_ids": [2, 7, 8], "labels": [-100, 7, 8], "label": 3}
    assert second.info()["hits"] == 4 and second.info()["tokenized"] == 0


def test_a_damaged_entry_is_rebuilt(tmp_path):
    (tmp_path / "e.npz").write_bytes(b"not a zip")
    cache = TokenCache(tmp_path / "e.npz")
    assert cache.wrap(lambda r: {"input_ids": [1]})({"a": 1}) == {"input_ids": [1]}
    cache.save()
    assert TokenCache(tmp_path / "e.npz").stored


def test_the_key_follows_file_tokenizer_template_and_max_length(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"question": "q", "answer": "a"}\n')
    tok = tiny_tokenizer()
    cfg = DataConfig(path=str(data), fields={"instruction": "question", "output": "answer"})
    src = [source_fingerprint(str(data))]
    base = entry_key(cfg, tok, 64, None, src)
    assert entry_key(cfg, tok, 64, None, src) == base
    assert entry_key(cfg, tok, 65, None, src) != base
    assert entry_key(DataConfig(path=str(data), template="vicuna", fields=cfg.fields), tok, 64, None, src) != base
    # selection-only options share the entry
    assert entry_key(DataConfig(path=str(data), fields=cfg.fields, max_examples=3), tok, 64, None, src) == base
    tok2 = tiny_tokenizer()
    tok2.chat_template = "{{ messages }}"
    assert entry_key(cfg, tok2, 64, None, src) != base
    data.write_text('{"question": "q2", "answer": "a"}\n')
    assert entry_key(cfg, tok, 64, None, [source_fingerprint(str(data))]) != base
    assert open_token_cache(DataConfig(path=str(data), cache=False), tok, 64, None, str(data)).path is None
    where = open_token_cache(DataConfig(path=str(data), cache_dir=str(tmp_path / "c")), tok, 64, None, str(data)).path
    assert where.parent == tmp_path / "c" / "tokenized"


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_second_run_and_resume_skip_tokenisation(tiny_recipe, tmp_path, monkeypatch, crash_at_round):
    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    data_dir_before = sorted(p.name for p in tmp_path.iterdir())
    first = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "a"))))
    s1 = _summary(first.run_dir)
    assert s1["startup"]["tokenized_cache"]["tokenized"] > 0 and s1["startup"]["tokenized_cache"]["hits"] == 0
    assert s1["startup_seconds"] > 0 and s1["startup"]["data_seconds"] > 0
    entries = list((tmp_path / "cache" / "tokenized").glob("*.npz"))
    assert len(entries) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(data_dir_before + ["a", "cache"])

    second = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "b"))))
    s2 = _summary(second.run_dir)
    assert s2["startup"]["tokenized_cache"]["tokenized"] == 0
    assert s2["startup"]["tokenized_cache"]["hits"] == 48  # every record of the fixture (some repeat)
    a = load_file(str(first.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(second.run_dir / "final" / "adapter.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    recipe = parse_recipe(tiny_recipe(output_dir=str(tmp_path / "c"), checkpoint={"every": 1}))
    crash_at_round(2)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    resumed = run(recipe, resume=True)
    assert _summary(resumed.run_dir)["startup"]["tokenized_cache"]["tokenized"] == 0
    c = load_file(str(resumed.run_dir / "final" / "adapter.safetensors"))
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_cache_off_writes_nothing(tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    result = run(parse_recipe(tiny_recipe(federation={"rounds": 1}, data={"cache": False})))
    cache = tmp_path / "cache"  # at most the device's measured matmul peak (fedllm.models.hardware), no tokens
    assert not cache.exists() or [p.name for p in cache.iterdir()] == ["device_peak.json"]
    assert _summary(result.run_dir)["startup"]["tokenized_cache"]["path"] is None
