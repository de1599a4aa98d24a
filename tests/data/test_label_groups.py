"""Label-permuted client groups (pFL^MF setup 3): same inputs, each group's own names for the classes."""

import json

import pytest

from fedllm.data.errors import PartitionError
from fedllm.data.label_groups import group_permutations, permute_label_groups


def records(n=40, labels=("add", "sub", "mul", "div")):
    return [{"text": f"problem {i}", "category": labels[i % len(labels)]} for i in range(n)]


def test_two_labels_two_groups_swap_the_labels():
    rows, maps = permute_label_groups(records(10, ("neg", "pos")), 4, 2, seed=3)
    assert maps == [{"neg": "neg", "pos": "pos"}, {"neg": "pos", "pos": "neg"}]  # the only other permutation
    originals = {r["text"]: r["category"] for r in records(10, ("neg", "pos"))}
    for r in rows:
        flipped = {"neg": "pos", "pos": "neg"}[originals[r["text"]]]
        assert r["group"] == r["client"] % 2
        assert r["category"] == (originals[r["text"]] if r["group"] == 0 else flipped)


def test_every_record_once_every_client_non_empty_and_distinct_bijections():
    rows, maps = permute_label_groups(records(), 8, 4, seed=0, column="category")
    assert sorted(r["text"] for r in rows) == sorted(r["text"] for r in records())
    assert sorted({r["client"] for r in rows}) == list(range(8))
    labels = {"add", "sub", "mul", "div"}
    assert all(set(m) == labels and set(m.values()) == labels for m in maps)
    assert len({tuple(sorted(m.items())) for m in maps}) == 4 and all(maps[0][k] == k for k in labels)
    assert [r["client"] for r in rows] == sorted(r["client"] for r in rows)


def test_impossible_requests_are_named():
    with pytest.raises(PartitionError, match="only 2 permutations"):
        group_permutations(["a", "b"], 3, 0)
    with pytest.raises(PartitionError, match="num_groups <= num_clients"):
        permute_label_groups(records(), 2, 3, 0)


def test_data_prep_script_writes_a_natural_split(tmp_path, capsys):
    from pathlib import Path

    from tests.conftest import load_script

    module = load_script(Path(__file__).parents[2] / "data_prep" / "permute_labels.py")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert module.main(["--data", str(src), "--num-clients", "4", "--groups", "2", "--out", str(tmp_path / "o")]) == 0
    rows = [json.loads(x) for x in (tmp_path / "o" / "data.jsonl").read_text().splitlines()]
    assert len(rows) == 40 and {r["group"] for r in rows} == {0, 1}
    assert json.loads((tmp_path / "o" / "groups.json").read_text())["column"] == "category"
    assert module.main(["--data", str(src), "--num-clients", "4", "--groups", "5", "--out", str(tmp_path / "x")]) == 2
    assert "num_groups <= num_clients" in capsys.readouterr().err
