"""Partition manifests: contents, atomic save, round trip, malformed files."""

from __future__ import annotations

import json

import pytest

from fedllm.data import PartitionError, load_manifest, manifest_clients, partition_manifest, save_manifest

RECORDS = [{"label": "x"}, {"label": "y"}, {"label": "x"}, {"label": "x"}]


def test_contents():
    m = partition_manifest([[0, 2], [1, 3]], RECORDS, method="iid", seed=7)
    assert m["num_clients"] == 2 and m["method"] == "iid" and m["seed"] == 7 and m["column"] == "label"
    assert m["clients"]["0"] == {"examples": [0, 2], "size": 2, "label_histogram": {"x": 2}}
    assert m["clients"]["1"]["label_histogram"] == {"x": 1, "y": 1}
    assert partition_manifest([[0], [1]], [{"t": 1}, {"t": 2}])["clients"]["0"]["label_histogram"] == {}


def test_round_trip_atomic(tmp_path):
    m = partition_manifest([[0, 2], [1, 3]], RECORDS, method="dirichlet")
    path = save_manifest(tmp_path / "sub" / "manifest.json", m)
    assert [p.name for p in path.parent.iterdir()] == ["manifest.json"]  # no temporary file left
    assert load_manifest(path) == m == load_manifest(path.parent)
    assert manifest_clients(m) == [[0, 2], [1, 3]]
    save_manifest(path.parent, {**m, "method": "iid"})  # a directory target gets manifest.json
    assert load_manifest(path)["method"] == "iid"


def test_malformed(tmp_path):
    with pytest.raises(PartitionError, match="no partition manifest"):
        load_manifest(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(PartitionError, match="not valid JSON"):
        load_manifest(bad)
    for clients, msg in [({"0": {"examples": [0]}, "2": {"examples": [1]}}, "0..1"),
                         ({"0": {"examples": []}}, "no examples"),
                         ({"0": {"examples": ["a"]}}, "list of record indices")]:
        bad.write_text(json.dumps({"num_clients": len(clients), "clients": clients}))
        with pytest.raises(PartitionError, match=msg) as e:
            load_manifest(bad)
        assert str(bad) in str(e.value)
