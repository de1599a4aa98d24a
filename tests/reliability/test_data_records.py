"""Bad data: every kind is named by file, record and field (exit 2) or dropped and counted, per data.on_bad_record."""

import json

import pytest
import yaml

from fedllm.commands.cli import main
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe
from tests.conftest import arith_records


def _train(tmp_path, raw, capsys, *extra):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    code = main(["train", str(recipe), *extra])
    return code, capsys.readouterr().err


def _lines(records):
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def test_non_utf8_bytes_name_the_file_and_line(tiny_recipe, tmp_path, capsys):
    for suffix, body in {
        ".jsonl": _lines(arith_records(2)) + b'{"question": "caf\xe9", "answer": "1"}\n',
        ".json": json.dumps(arith_records(2), indent=0).encode().replace(b"What", b"Wh\xffat", 2),
        ".csv": b"question,answer\nWhat is 1 + 1?,2\nWhat is 2 \xfe 2?,4\n",
    }.items():
        data = tmp_path / f"bad{suffix}"
        data.write_bytes(body)
        code, err = _train(tmp_path, tiny_recipe(data={"path": str(data)}), capsys)
        line = body[: body.index(next(b for b in (b"\xe9", b"\xff", b"\xfe") if b in body))].count(b"\n") + 1
        assert code == 2, err
        assert f"{data}:{line}: not UTF-8 text" in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value,kind", [(None, "null"), (7, "int"), (["a", "b"], "list"), ("MISSING", "missing")])
def test_missing_or_mistyped_fields_name_file_record_and_field(tiny_recipe, tmp_path, capsys, value, kind):
    records = arith_records(12)
    if value == "MISSING":
        del records[4]["answer"]
    else:
        records[4]["answer"] = value
    records[9]["answer"] = 3  # a second bad record is counted, not listed
    data = tmp_path / "d.jsonl"
    data.write_bytes(_lines(records))
    code, err = _train(tmp_path, tiny_recipe(data={"path": str(data)}), capsys)
    assert code == 2
    assert f"{data}: record 5: field 'answer' (data.fields maps 'output' to it) is " + (
        "missing" if kind == "missing" else kind) in err, err
    assert "1 more record(s)" in err
    if kind != "missing":
        assert "expected a string" in err


def test_a_null_optional_input_is_fine(tiny_recipe, tmp_path):
    records = [{**r, "context": None} for r in arith_records(24)]
    data = tmp_path / "d.jsonl"
    data.write_bytes(_lines(records))
    raw = tiny_recipe(data={"path": str(data), "fields": {"instruction": "question", "output": "answer",
                                                         "input": "context"}}, federation={"rounds": 1})
    run(parse_recipe(raw))


def _empty_records(n=24, empty=(3, 10)):
    records = arith_records(n)
    for i in empty:
        records[i]["answer"] = "  \n"
    return records


def test_empty_records_error_names_the_record(tiny_recipe, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_bytes(_lines(_empty_records()))
    code, err = _train(tmp_path, tiny_recipe(data={"path": str(data), "on_bad_record": "error"}), capsys)
    assert code == 2
    assert f"{data}: record " in err and "a required text is empty (data.on_bad_record: error" in err
    n = int(err.split(f"{data}: record ")[1].split(" ")[0])
    assert n in (4, 11)


def test_empty_records_are_dropped_and_counted_per_client(tiny_recipe, tmp_path, caplog):
    data = tmp_path / "d.jsonl"
    data.write_bytes(_lines(_empty_records()))
    with caplog.at_level("WARNING"):
        result = run(parse_recipe(tiny_recipe(data={"path": str(data)}, federation={"rounds": 1})))
    part = json.loads((result.run_dir / "partition.json").read_text())
    counts = part["bad_records"]["counts"]
    assert part["bad_records"]["policy"] == "drop"
    owners = {int(c): entry["examples"] for c, entry in part["clients"].items()}
    for c in range(3):
        expected_empty = sum(i in owners[c] for i in (3, 10))
        assert counts[f"client {c}"] == {"empty": expected_empty, "too_long": 0, "too_large": 0,
                                         "kept": len(owners[c]) - expected_empty, "truncated": 0}
    assert "dropped 1 empty record(s)" in caplog.text or "dropped 2 empty record(s)" in caplog.text


def _chat(tmp_path, long_at=(2,)):
    rows = []
    for i in range(24):
        user = "word " * (400 if i in long_at else 3)
        rows.append({"messages": [{"role": "user", "content": user + f"q{i}"},
                                  {"role": "assistant", "content": f"answer {i}"}]})
    path = tmp_path / "chat.jsonl"
    path.write_bytes(_lines(rows))
    return path


def test_over_length_records_are_dropped_and_counted_or_refused(tiny_recipe, tmp_path, capsys):
    data = _chat(tmp_path)
    raw = tiny_recipe(data={"path": str(data), "format": "chat", "fields": {}}, federation={"rounds": 1},
                      train={"max_length": 48})
    result = run(parse_recipe(raw))
    counts = json.loads((result.run_dir / "partition.json").read_text())["bad_records"]["counts"]
    assert sum(c["too_long"] for c in counts.values()) == 1 and sum(c["empty"] for c in counts.values()) == 0
    assert sum(c["kept"] for k, c in counts.items() if k.startswith("client")) == 23
    code, err = _train(tmp_path, {**raw, "output_dir": str(tmp_path / "strict"),
                                  "data": {**raw["data"], "on_bad_record": "error"}}, capsys)
    assert code == 2 and f"{data}: record 3 (client " in err and "no trainable token is left within max_length=48" in err


def test_truncated_records_are_kept_and_counted_per_client(tiny_recipe, tmp_path, arith_file):
    rows = [json.loads(line) for line in arith_file.read_text().splitlines()]
    long_ids = (1, 7, 30)
    for i in long_ids:  # a long answer: truncated, but trainable tokens remain within max_length
        rows[i]["answer"] = "carry the one " * 60 + rows[i]["answer"]
    data = tmp_path / "long.jsonl"
    data.write_bytes(_lines(rows))
    result = run(parse_recipe(tiny_recipe(data={"path": str(data)}, federation={"rounds": 1})))
    part = json.loads((result.run_dir / "partition.json").read_text())
    counts = part["bad_records"]["counts"]
    owners = {int(c): entry["examples"] for c, entry in part["clients"].items()}
    for c in range(3):
        assert counts[f"client {c}"]["truncated"] == sum(i in owners[c] for i in long_ids)
        assert counts[f"client {c}"]["too_long"] == 0 and counts[f"client {c}"]["kept"] == len(owners[c])


def test_chat_turn_with_non_text_content_is_named(tiny_recipe, tmp_path, capsys):
    data = _chat(tmp_path, long_at=())
    rows = [json.loads(x) for x in data.read_text().splitlines()]
    rows[6]["messages"][1]["content"] = {"text": "hi"}
    data.write_bytes(_lines(rows))
    code, err = _train(tmp_path, tiny_recipe(data={"path": str(data), "format": "chat", "fields": {}}), capsys)
    assert code == 2 and f"{data}: record 7: " in err, err
