"""Bad recipe values of the reliability issue: each one is reported, all at once, with exit 2."""

import pytest

from fedllm.commands.cli import main
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError


def base(**over):
    raw = {"data": {"path": "x.jsonl"}, "train": {"local_steps": 1, "lr": 1e-3}}
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return raw


BAD = [
    ({"train": {"lr": float("nan")}}, "train.lr", "a finite number"),
    ({"train": {"lr": float("inf")}}, "train.lr", "a finite number"),
    ({"lora": {"alpha": float("-inf")}}, "lora.alpha", "a finite number"),
    ({"federation": {"strategy_args": {"server_lr": float("nan")}}}, "federation.strategy_args.server_lr",
     "a finite number"),
    ({"train": {"min_lr": -1e-4}}, "train.min_lr", "[0, train.lr]"),
    ({"train": {"min_lr": 1e-2}}, "train.min_lr", "[0, train.lr]"),
    ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last", ">= 1"),
    ({"checkpoint": {"keep_last": -1}}, "checkpoint.keep_last", ">= 1"),
    ({"eval": {"limit": -1}}, "eval.limit", ">= 1"),
    ({"eval": {"limit": 0}}, "eval.limit", ">= 1"),
    ({"eval": {"max_new_tokens": -1}}, "eval.max_new_tokens", ">= 1"),
    ({"output_dir": ""}, "output_dir", "non-empty"),
    ({"output_dir": "   "}, "output_dir", "non-empty"),
    ({"federation": {"num_clients": 4, "clients_per_round": 2, "min_clients_per_round": 3}},
     "federation.min_clients_per_round", "1..clients sampled per round (2)"),
    ({"federation": {"on_client_error": "ignore"}}, "federation.on_client_error", "'skip', 'fail'"),
    ({"data": {"on_bad_record": "keep"}}, "data.on_bad_record", "'error', 'drop'"),
]


@pytest.mark.parametrize("over,key,expected", BAD, ids=[b[1] + ":" + repr(list(b[0].values())[0]) for b in BAD])
def test_each_bad_value_is_named(over, key, expected):
    with pytest.raises(RecipeError) as e:
        parse_recipe(base(**over), "r.yaml")
    problems = {k: exp for k, _, exp in e.value.problems}
    assert key in problems, e.value
    assert expected in problems[key]


def test_good_boundary_values_pass():
    r = parse_recipe(base(train={"min_lr": 1e-3}, checkpoint={"keep_last": 1}, eval={"limit": 1, "max_new_tokens": 1},
                          federation={"num_clients": 3, "min_clients_per_round": 3}))
    assert r.train.min_lr == r.train.lr and r.checkpoint.keep_last == 1 and r.eval.limit == 1
    r = parse_recipe(base(checkpoint={"keep_last": None}, eval={"limit": None, "max_new_tokens": None}))
    assert r.checkpoint.keep_last is None and r.eval.limit is None and r.eval.max_new_tokens is None
    assert r.data.on_bad_record == "drop" and r.federation.on_client_error == "skip"


def test_all_problems_at_once_and_exit_2(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    out = tmp_path / "out"
    (tmp_path / "x.jsonl").write_text('{"instruction": "a", "output": "b"}\n' * 2)  # one per client (default 2)
    recipe.write_text(f"output_dir: {out}\ndata: {{path: {tmp_path / 'x.jsonl'}}}\n"
                      "train: {local_steps: 1, lr: .nan}\ncheckpoint: {keep_last: -1}\n"
                      "eval: {limit: -1, max_new_tokens: 0}\n")
    assert main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"{recipe}: 4 problem(s)" in err
    for key in ("train.lr: got nan", "checkpoint.keep_last: got -1", "eval.limit: got -1", "eval.max_new_tokens: got 0"):
        assert key in err
    assert not out.exists()
