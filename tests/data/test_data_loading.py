"""load_records: every local form, directories, and the errors."""

from __future__ import annotations

import json

import pytest

from fedllm.data import DataError, load_records

ROWS = [{"instruction": "Say hi", "input": "", "output": "hi", "label": 1},
        {"instruction": "Add", "input": "1 2", "output": "3", "label": 0}]


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps(ROWS))
    assert load_records(str(path)) == ROWS


def test_json_object_under_data_or_split(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"data": ROWS}))
    (tmp_path / "b.json").write_text(json.dumps({"train": ROWS[:1], "test": ROWS[1:]}))
    assert load_records(str(tmp_path / "a.json")) == ROWS
    assert load_records(str(tmp_path / "b.json"), split="test") == ROWS[1:]
    with pytest.raises(DataError, match="'data' or 'validation'"):
        load_records(str(tmp_path / "b.json"), split="validation")


def test_jsonl_skips_blank_lines(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert load_records(str(path)) == ROWS


def test_jsonl_bad_line_names_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2"):
        load_records(str(path))


def test_csv_and_parquet(tmp_path):
    import datasets

    datasets.Dataset.from_list(ROWS).to_csv(str(tmp_path / "d.csv"), index=False)
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    csv_rows = load_records(str(tmp_path / "d.csv"))
    assert [r["output"] for r in csv_rows] == ["hi", "3"] and [r["label"] for r in csv_rows] == [1, 0]
    assert load_records(str(tmp_path / "d.parquet")) == ROWS


def test_directory_picks_split_file(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / "test.json").write_text(json.dumps(ROWS[:1]))
    assert load_records(str(tmp_path)) == ROWS
    assert load_records(str(tmp_path), split="test") == ROWS[:1]
    with pytest.raises(DataError, match="no validation.jsonl"):
        load_records(str(tmp_path), split="validation")


@pytest.mark.parametrize("path", ["./nope/train.jsonl", "missing.csv", "/no/such/dir", "~/no-such-file-here"])
def test_missing_local_path(path):
    with pytest.raises(DataError, match="no such file") as e:
        load_records(path)
    assert path in str(e.value) and ".jsonl" in str(e.value)


def test_hub_id_offline_is_a_data_error():
    with pytest.raises(DataError) as e:
        load_records("fedllm-test-org/no-such-dataset", "main")
    msg = str(e.value)
    assert "fedllm-test-org/no-such-dataset" in msg and "offline" in msg and "local file" in msg


def test_bad_contents(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "scalar.json").write_text("3")
    (tmp_path / "strings.json").write_text('["a"]')
    (tmp_path / "d.xml").write_text("<a/>")
    with pytest.raises(DataError, match="no records"):
        load_records(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match="expected a JSON list"):
        load_records(str(tmp_path / "scalar.json"))
    with pytest.raises(DataError, match="record 1 is a str"):
        load_records(str(tmp_path / "strings.json"))
    with pytest.raises(DataError, match="unsupported file type"):
        load_records(str(tmp_path / "d.xml"))
    assert issubclass(DataError, ValueError)


def test_early_record_count_equals_the_loaders(tmp_path):
    """What validation counts before loading (json/jsonl, a directory's split file) is what load_records returns."""
    from fedllm.data.loading import count_local_records

    rec = {"q": "1"}
    (tmp_path / "a.jsonl").write_text("\n" + json.dumps(rec) + "\n  \n" + json.dumps(rec) + "\n\n" + json.dumps(rec))
    (tmp_path / "b.json").write_text(json.dumps({"test": [rec] * 4, "data": [rec] * 2}))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "train.json").write_text(json.dumps([rec] * 5))
    (tmp_path / "d" / "train.jsonl").write_text(json.dumps(rec) + "\n")  # the loader reads train.json first
    for path, split in (("a.jsonl", "train"), ("b.json", "train"), ("b.json", "test"), ("d", "train")):
        assert count_local_records(str(tmp_path / path), split) == len(load_records(str(tmp_path / path), None, split))
    assert [count_local_records(str(tmp_path / p)) for p in ("a.jsonl", "b.json", "d")] == [3, 2, 5]
    (tmp_path / "c.csv").write_text("q\n1\n")
    assert count_local_records(str(tmp_path / "c.csv")) is None  # csv/parquet: left to the loader
    assert count_local_records(str(tmp_path / "missing.jsonl")) is None
