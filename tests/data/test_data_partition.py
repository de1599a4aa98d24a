"""Partitioners: sizes, determinism, Dirichlet skew, natural split, and their errors."""

from __future__ import annotations

import numpy as np
import pytest

from fedllm.common.registry import partitioners
from fedllm.data import PartitionError, partition_records
from fedllm.recipe.schema import PartitionConfig

LABELS = ["a", "b", "c", "d"]


def records(n: int = 400, column: str = "label") -> list[dict]:
    return [{"text": f"t{i}", column: LABELS[i % len(LABELS)]} for i in range(n)]


def check_partition(parts: list[list[int]], n: int) -> None:
    flat = [i for p in parts for i in p]
    assert sorted(flat) == list(range(n))
    assert all(p == sorted(p) and p for p in parts)


def test_registered():
    assert {"iid", "dirichlet", "natural"} <= set(partitioners.names())


def test_iid_sizes_and_determinism():
    cfg = PartitionConfig(method="iid")
    parts = partition_records(records(103), 4, 0, cfg)
    check_partition(parts, 103)
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]
    assert parts == partition_records(records(103), 4, 0, cfg)
    assert parts != partition_records(records(103), 4, 1, cfg)


def test_dirichlet_determinism_and_min_size():
    cfg = PartitionConfig(method="dirichlet", beta=0.5, min_size=20)
    parts = partition_records(records(), 5, 3, cfg)
    check_partition(parts, 400)
    assert min(len(p) for p in parts) >= 20
    assert parts == partition_records(records(), 5, 3, cfg)
    assert parts != partition_records(records(), 5, 4, cfg)


def mean_tv_distance(parts: list[list[int]], recs: list[dict]) -> float:
    """Mean over clients of the total-variation distance to the global label distribution."""
    labels = np.array([LABELS.index(r["label"]) for r in recs])
    global_hist = np.bincount(labels, minlength=len(LABELS)) / len(labels)
    dists = []
    for p in parts:
        hist = np.bincount(labels[p], minlength=len(LABELS)) / len(p)
        dists.append(0.5 * np.abs(hist - global_hist).sum())
    return float(np.mean(dists))


def test_dirichlet_skew_grows_as_beta_falls():
    recs = records()
    skew = {
        beta: np.mean([mean_tv_distance(partition_records(recs, 4, s, PartitionConfig("dirichlet", beta=beta)), recs)
                       for s in range(5)])
        for beta in (0.1, 1.0, 10.0)
    }
    assert skew[0.1] > skew[1.0] > skew[10.0]
    assert skew[0.1] > 0.4 and skew[10.0] < 0.15


def test_dirichlet_uses_category_by_default_and_given_column():
    parts = partition_records(records(column="category"), 2, 0, PartitionConfig("dirichlet"))
    check_partition(parts, 400)
    recs = [{"user": i % 3, "x": i} for i in range(30)]
    check_partition(partition_records(recs, 3, 0, PartitionConfig("dirichlet", column="user")), 30)


def test_natural_split():
    recs = [{"writer": w, "text": str(i)} for i, w in enumerate(["bo", "al", "cy", "al", "bo", "al"])]
    parts = partition_records(recs, 3, 0, PartitionConfig("natural", column="writer"))
    assert parts == [[0, 4], [1, 3, 5], [2]]  # values in the order they first appear: bo, al, cy


def test_more_clients_than_examples():
    for method in ("iid", "dirichlet", "natural"):
        with pytest.raises(PartitionError, match="3 examples into 4 clients"):
            partition_records(records(3), 4, 0, PartitionConfig(method))


def test_missing_column():
    recs = [{"text": "x"}, {"text": "y"}]
    for method in ("dirichlet", "natural"):
        with pytest.raises(PartitionError, match="federation.partition.column"):
            partition_records(recs, 2, 0, PartitionConfig(method))
    with pytest.raises(PartitionError, match="'topic' is missing from record 2"):
        partition_records([{"topic": 1}, {"text": "y"}], 2, 0, PartitionConfig("dirichlet", column="topic"))


def test_natural_count_mismatch():
    recs = [{"label": f"u{i % 3}"} for i in range(9)]
    with pytest.raises(PartitionError) as e:
        partition_records(recs, 4, 0, PartitionConfig("natural"))
    assert "gives 3 clients" in str(e.value) and "num_clients is 4" in str(e.value)


def test_natural_fewer_clients_keeps_the_first_values_in_file_order(caplog):
    """FedLLM-Bench's ``dataset[:num_clients]``: the first users (in file order) are the clients, the rest left out."""
    recs = [{"user": u} for u in ["z", "z", "a", "m", "a", "q"]]
    with caplog.at_level("WARNING"):
        parts = partition_records(recs, 2, 0, PartitionConfig("natural", column="user"))
    assert parts == [[0, 1], [2, 4]]
    assert "the other 2 values' 2 record(s) are left out" in caplog.text


def test_dirichlet_impossible_min_size():
    one_class = [{"label": "a"} for _ in range(5)]
    with pytest.raises(PartitionError, match="raise beta"):
        partition_records(one_class, 4, 0, PartitionConfig("dirichlet", beta=0.01))
    with pytest.raises(PartitionError, match="min_size=2"):
        partition_records(one_class, 4, 0, PartitionConfig("dirichlet", min_size=2))


def test_empty_client_is_an_error(monkeypatch):
    monkeypatch.setitem(partitioners._items, "lopsided", lambda recs, n, seed, cfg: [list(range(len(recs)))] + [[]] * (n - 1))
    with pytest.raises(PartitionError, match="client 1 with no examples"):
        partition_records(records(10), 2, 0, PartitionConfig("lopsided"))


def test_unknown_method():
    with pytest.raises(PartitionError, match="known: dirichlet, iid, natural"):
        partition_records(records(10), 2, 0, PartitionConfig("zipf"))
