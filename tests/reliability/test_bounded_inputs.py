"""Hostile recipes and data are refused at once with exit 2 naming the file (issue #20, items 5-7): alias bombs,
duplicate keys, deep nesting, non-UTF-8 bytes, huge integers, unbounded strategy arguments, oversized records;
a byte-order mark is accepted and ``~`` is expanded."""

import json
import time

import pytest
import yaml

from fedllm.commands.cli import main
from fedllm.recipe.checks import load_recipe, parse_recipe
from tests.conftest import arith_records

BOMB = "lol0: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"lol{i}: &{c} [{', '.join(['*' + p] * 9)}]\n" for i, (p, c) in enumerate(zip("abcdefgh", "bcdefghi"), 1))


def _train(path, capsys, *extra):
    code = main(["train", str(path), *extra])
    return code, capsys.readouterr().err


def _write(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def test_hostile_recipe_texts_exit_2_naming_the_file(tiny_recipe, tmp_path, capsys):
    good = yaml.safe_dump(tiny_recipe())
    cases = {
        "alias bomb": (good + BOMB, "more than 100,000 values once aliases are expanded"),
        "duplicate key": (good + "seed: 3\n", "duplicate key 'seed' (line"),
        "deep list": (good + "extra: " + "[" * 50_000 + "]" * 50_000 + "\n", "nested deeper than 64 levels"),
        "nested 70": (good + "extra: " + "[" * 70 + "]" * 70 + "\n", "nested deeper than 64 levels"),
        "not UTF-8": (good.encode() + b"# caf\xe9\n", "byte 0xe9 on line"),
    }
    for name, (text, expected) in cases.items():
        path = _write(tmp_path, text)
        started = time.process_time()  # this process's CPU time: what expanding the bomb would cost, at any load
        code, err = _train(path, capsys)
        assert code == 2 and str(path) in err and expected in err, (name, err)
        assert time.process_time() - started < 10, name  # the bomb is refused, not expanded
    assert not (tmp_path / "run").exists()


def test_a_byte_order_mark_is_accepted_and_tilde_is_expanded(tiny_recipe, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw = tiny_recipe(output_dir="~/runs/x", data={"path": tiny_recipe()["data"]["path"]})
    path = _write(tmp_path, b"\xef\xbb\xbf" + yaml.safe_dump(raw).encode())
    recipe = load_recipe(path, ["data.cache_dir=~/cache"], check_files=True)
    assert recipe.output_dir == str(tmp_path / "home" / "runs" / "x")
    assert recipe.data.cache_dir == str(tmp_path / "home" / "cache")


@pytest.mark.parametrize("override,expected", [
    ("seed=1180591620717411303424", "seed: got 1180591620717411303424; expected an integer within 64 bits"),
    ("seed=-1", "seed: got -1; expected an integer in 0..9223372036854775807"),
    ("eval.seed=-5", "eval.seed: got -5; expected an integer in 0..9223372036854775807"),
    ("federation.rounds=100000000000000000000", "federation.rounds: got 100000000000000000000; expected an integer "
                                                "within 64 bits"),
    ("data.max_record_chars=0", "data.max_record_chars: got 0"),
    ("federation.strategy_args.tau=1000000000", "federation.strategy_args.tau: got 1000000000; expected counts of at "
                                                "most 1,000,000"),
    ("federation.strategy_args={client_ranks: [2, 100000000]}", "federation.strategy_args.client_ranks"),
    ("train.lr=[", "train.lr: got '['; expected a YAML value"),
])
def test_out_of_range_values_exit_2(tiny_recipe, tmp_path, capsys, override, expected):
    raw = tiny_recipe()
    if "tau" in override:
        raw["federation"]["strategy"] = "fedloru"
    if "client_ranks" in override:
        raw["federation"]["strategy"] = "flexlora"
    path = _write(tmp_path, yaml.safe_dump(raw))
    code, err = _train(path, capsys, override)
    assert code == 2 and str(path) in err and expected in err, err


def test_frlora_niter_is_bounded(tiny_recipe):
    from fedllm.recipe.schema import RecipeError

    raw = tiny_recipe(federation={"strategy": "frlora", "strategy_args": {"svd": "randomized", "niter": 10**12}})
    with pytest.raises(RecipeError, match=r"federation.strategy_args.niter: got 1000000000000; expected an integer "
                                          r"in 0..100"):
        parse_recipe(raw)


def _data(tmp_path, recipe):
    from fedllm.data import build_federated_data
    from fedllm.models.loading import load_tokenizer, resolve_task

    tok = load_tokenizer(recipe.model)
    return build_federated_data(recipe.data, recipe.federation.partition, recipe.federation.num_clients, tok,
                                recipe.train.max_length, recipe.seed, resolve_task(recipe.model))


def test_oversized_records_are_bad_records_before_tokenizing_and_deep_lines_are_named(tiny_recipe, tmp_path,
                                                                                     capsys):
    from fedllm.data.errors import DataError

    records = arith_records(24)
    records[6]["question"] = "What is " + "1 + " * 100 + "1?"  # 400+ characters
    data = tmp_path / "d.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())  # with a BOM
    raw = tiny_recipe(data={"path": str(data), "max_record_chars": 300})
    fed = _data(tmp_path, parse_recipe(raw))
    counts = fed.manifest["bad_records"]["counts"]
    assert sum(c["too_large"] for c in counts.values()) == 1 and sum(c["kept"] for c in counts.values()) == 23
    with pytest.raises(DataError, match=r"record 7 \(client \d\): more than data.max_record_chars=300 characters"):
        _data(tmp_path, parse_recipe({**raw, "data": {**raw["data"], "on_bad_record": "error"}}))
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(records[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    path = _write(tmp_path, yaml.safe_dump(tiny_recipe(data={"path": str(deep)}, federation={"num_clients": 2})))
    code, err = _train(path, capsys)
    assert code == 2 and f"{deep}:2: nested too deeply to read" in err, err


def test_export_client_and_overwrite_of_a_symlink_exit_2(run_copy, tmp_path, capsys):
    run_dir, raw = run_copy
    with pytest.raises(SystemExit) as stopped:  # an argparse usage error: exit 2, not a ValueError trace
        main(["export", str(run_dir), "--format", "adapter", "--out", str(tmp_path / "e"), "--client", "²"])
    assert stopped.value.code == 2 and "expected a client id, 'all' or 'global', got '²'" in capsys.readouterr().err
    link = tmp_path / "link"
    link.symlink_to(run_dir)
    path = _write(tmp_path, yaml.safe_dump({**raw, "output_dir": str(link)}))
    code, err = _train(path, capsys, "--overwrite")
    assert code == 2 and f"--overwrite refuses output_dir={str(link)!r}: it is a symbolic link" in err, err
    assert (run_dir / "final" / "adapter.safetensors").is_file()
