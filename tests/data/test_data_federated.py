"""build_federated_data and partition_to_disk on the fixture data sets."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fedllm.data import DataError, PartitionError, build_federated_data, load_records, partition_to_disk
from fedllm.data.tokens import IGNORE_INDEX
from fedllm.recipe.schema import DataConfig, PartitionConfig
from tests.conftest import load_script as load_repo_script

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "data"
ROOT = Path(__file__).resolve().parents[2]
ARITH = DataConfig(path=str(ASSETS / "arith"), fields={"instruction": "question", "output": "answer"})


def build(data_cfg=ARITH, partition_cfg=PartitionConfig(), num_clients=4, tokenizer=None, max_length=256, seed=0,
          task="causal_lm"):
    return build_federated_data(data_cfg, partition_cfg, num_clients, tokenizer, max_length, seed, task)


def test_iid_arith(tokenizer):
    data = build(tokenizer=tokenizer)
    assert data.num_clients == 4 and len(data.examples) == 48
    assert sorted(i for c in data.clients for i in c) == list(range(48))
    assert [data.num_examples(c) for c in range(4)] == [12, 12, 12, 12]
    ex = data.client_examples(0)[0]
    assert set(ex) == {"input_ids", "labels"} and ex["labels"][0] == IGNORE_INDEX and ex["labels"][-1] == tokenizer.eos_token_id
    assert data.eval_records == [] and data.eval_examples == [] and data.label_names is None
    assert data.client_eval == [[], [], [], []]
    assert data.manifest["method"] == "iid" and data.manifest["column"] == "category"
    again = build(tokenizer=tokenizer)
    assert again.examples == data.examples and again.manifest == data.manifest
    assert build(tokenizer=tokenizer, seed=1).manifest["clients"] != data.manifest["clients"]


def test_eval_fraction_cap_and_personal_split(tokenizer):
    cfg = dataclasses.replace(ARITH, max_examples=40, eval_fraction=0.1, client_eval_fraction=0.25)
    data = build(cfg, PartitionConfig("natural"), tokenizer=tokenizer)
    assert len(data.eval_records) == len(data.eval_examples) == 4
    assert sum(len(c) for c in data.clients) + sum(len(e) for e in data.client_eval) == 36
    for c in range(4):
        cats = {r["category"] for r in data.client_eval_records[c]}
        assert len(cats) == 1 and len(data.client_eval[c]) == len(data.client_eval_records[c]) >= 1
    held = {r["question"] for r in data.eval_records}
    train_ids = [i for cl in data.manifest["clients"].values() for i in cl["examples"]]
    records = load_records(ARITH.path)
    assert not held & {records[i]["question"] for i in train_ids}


def test_eval_split_from_directory(tokenizer):
    cfg = dataclasses.replace(ARITH, eval_split="test")
    data = build(cfg, tokenizer=tokenizer)
    assert data.eval_records == load_records(ARITH.path, split="test") and len(data.eval_examples) == 12
    assert len(data.examples) == 48


def test_manifest_round_trip(tmp_path, tokenizer):
    pcfg = PartitionConfig("dirichlet", beta=0.5, min_size=3)
    cfg = dataclasses.replace(ARITH, eval_fraction=0.25)
    manifest = partition_to_disk(cfg, pcfg, 3, 5, tmp_path / "parts")
    files = sorted(p.name for p in (tmp_path / "parts").iterdir())
    assert files == ["client_000.jsonl", "client_001.jsonl", "client_002.jsonl", "eval.jsonl", "manifest.json"]
    records = load_records(ARITH.path)
    for c in range(3):
        rows = load_records(str(tmp_path / "parts" / f"client_{c:03d}.jsonl"))
        assert rows == [records[i] for i in manifest["clients"][str(c)]["examples"]]
        assert sum(manifest["clients"][str(c)]["label_histogram"].values()) == len(rows) >= 3
    direct = build(cfg, pcfg, num_clients=3, tokenizer=tokenizer, seed=5)
    assert direct.manifest["clients"] == manifest["clients"]
    from_disk = build(DataConfig(fields=ARITH.fields), PartitionConfig(path=str(tmp_path / "parts")), 3, tokenizer, seed=99)
    assert from_disk.examples == direct.examples and from_disk.eval_records == direct.eval_records
    with pytest.raises(PartitionError, match="3 clients but num_clients is 4"):
        build(ARITH, PartitionConfig(path=str(tmp_path / "parts")), 4, tokenizer)
    with pytest.raises(PartitionError, match="another data file"):
        build(DataConfig(path=str(ASSETS / "alpaca_tiny.jsonl")), PartitionConfig(path=str(tmp_path / "parts")), 3, tokenizer)


def test_classification(tokenizer):
    cfg = DataConfig(path=str(ASSETS / "sentiment_tiny.csv"), format="classification", eval_fraction=0.25)
    data = build(cfg, PartitionConfig("dirichlet", beta=1.0), 2, tokenizer, 32, task="classification")
    assert data.label_names == ["negative", "positive"]
    assert len(data.examples) == 9 and len(data.eval_examples) == 3
    assert {e["label"] for e in data.examples + data.eval_examples} == {0, 1}
    assert data.manifest["column"] == "label"


def test_chat_and_sharegpt_fixtures(tokenizer):
    chat = DataConfig(path=str(ASSETS / "chat_tiny.jsonl"), format="chat", template="tokenizer")
    share = DataConfig(path=str(ASSETS / "sharegpt_tiny.json"), format="chat", template="tokenizer")
    a, b = build(chat, num_clients=2, tokenizer=tokenizer), build(share, num_clients=2, tokenizer=tokenizer)
    assert len(a.examples) == 6 and a.examples == b.examples


def test_errors(tokenizer):
    with pytest.raises(DataError, match="trains a causal_lm model"):
        build(tokenizer=tokenizer, task="classification")
    long_user = DataConfig(path=str(ASSETS / "chat_tiny.jsonl"), format="chat", template="tokenizer")
    with pytest.raises(DataError, match="client 0: none of its 3 records"):
        build(long_user, num_clients=2, tokenizer=tokenizer, max_length=4)
    with pytest.raises(PartitionError, match="more clients than examples"):
        build(DataConfig(path=str(ASSETS / "alpaca_tiny.jsonl")), num_clients=13, tokenizer=tokenizer)
    with pytest.raises(DataError, match="client_eval_fraction"):
        build(DataConfig(path=str(ASSETS / "alpaca_tiny.jsonl"), client_eval_fraction=0.5), num_clients=12,
              tokenizer=tokenizer)


def load_script(name: str):
    return load_repo_script(ROOT / "data_prep" / f"{name}.py", f"data_prep_{name}")


def test_data_prep_scripts(tmp_path, capsys):
    assert load_script("make_arith").main(["--out", str(tmp_path / "arith"), "--train", "40", "--test", "8"]) == 0
    train = load_records(str(tmp_path / "arith"))
    assert len(train) == 40 and len(load_records(str(tmp_path / "arith"), split="test")) == 8
    assert train == load_records(str(ASSETS / "arith"))[:40]  # same seed: a prefix of the fixture
    script = load_script("partition")
    args = ["--data", str(tmp_path / "arith" / "train.jsonl"), "--num-clients", "4", "--method", "natural", "--out",
            str(tmp_path / "parts")]
    assert script.main(args) == 0
    manifest = json.loads((tmp_path / "parts" / "manifest.json").read_text())
    first_seen = list(dict.fromkeys(r["category"] for r in train))   # natural: clients in file order
    assert [c["label_histogram"] for c in manifest["clients"].values()] == [{op: 10} for op in first_seen]
    assert script.main(args[:3] + ["5"] + args[4:]) == 2
    assert "num_clients is 5" in capsys.readouterr().err


def test_partition_command_from_recipe(tmp_path, tokenizer):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "# fedllm train r.yaml\nseed: 3\n"
        f"data: {{path: {ASSETS / 'arith'}, fields: {{instruction: question, output: answer}}, eval_fraction: 0.25}}\n"
        "federation: {num_clients: 4, partition: {method: dirichlet, beta: 1.0}}\ntrain: {local_steps: 1}\n"
    )
    script = load_script("partition")
    assert script.main(["--recipe", str(recipe), "--out", str(tmp_path / "a")]) == 0
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["seed"] == 3 and manifest["num_clients"] == 4 and len(manifest["eval"]) == 12
    cfg = dataclasses.replace(ARITH, eval_fraction=0.25)
    direct = build(cfg, PartitionConfig("dirichlet", beta=1.0), 4, tokenizer, seed=3)
    assert direct.manifest["clients"] == manifest["clients"]
    assert script.main(["--recipe", str(recipe), "--num-clients", "2", "--method", "iid", "--out", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["method"] == "iid"
    assert script.main(["--out", str(tmp_path / "c")]) == 2
