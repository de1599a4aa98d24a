from pathlib import Path

import pytest
import yaml

from fedllm.recipe.checks import load_recipe, parse_recipe
from fedllm.recipe.schema import RecipeError

ROOT = Path(__file__).resolve().parents[1]


def base(**over):
    raw = {"data": {"path": "x.jsonl"}, "train": {"local_steps": 1}}
    for k, v in over.items():
        raw[k] = v
    return raw


def test_defaults_and_overrides():
    r = parse_recipe(base(), "r.yaml", ["federation.rounds=3", "lora.r=16", "train.lr=1e-3",
                                        "federation.strategy_args={weighting: uniform}"])
    assert r.federation.rounds == 3 and r.lora.r == 16 and r.train.lr == 1e-3
    assert r.federation.strategy_args == {"weighting": "uniform"}
    assert r.source == "r.yaml"


def test_every_problem_is_reported_at_once_with_key_value_and_expectation():
    raw = base(lora={"r": 0, "alpah": 3}, federation={"num_clients": 2, "clients_per_round": 5})
    raw["train"]["batch_size"] = "four"
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw, "bad.yaml")
    msg = str(e.value)
    assert msg.startswith("bad.yaml:")
    assert "lora.alpah" in msg and "known key" in msg
    assert "train.batch_size: got 'four'; expected an integer" in msg
    # semantic checks run once the types are right:
    raw = base(lora={"r": 0}, federation={"num_clients": 2, "clients_per_round": 5, "strategy": "nope"})
    with pytest.raises(RecipeError) as e:
        parse_recipe(raw, "bad.yaml")
    keys = [p[0] for p in e.value.problems]
    assert {"lora.r", "federation.clients_per_round", "federation.strategy"} <= set(keys)
    assert "got 5; expected an integer in 1..num_clients (2)" in str(e.value)


def test_strategy_args_are_checked():
    with pytest.raises(RecipeError) as e:
        parse_recipe(base(federation={"strategy": "fedavg", "strategy_args": {"weighting": "sizes", "foo": 1}}))
    keys = [p[0] for p in e.value.problems]
    assert "federation.strategy_args.weighting" in keys and "federation.strategy_args.foo" in keys


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(RecipeError, match="existing recipe YAML"):
        load_recipe(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(RecipeError, match="valid YAML"):
        load_recipe(bad)


@pytest.mark.parametrize("lines, line", [
    pytest.param({18: "  strategy fedavg"}, 18, id="a key without its colon"),
    pytest.param({14: "lora: {r: 4, alpha: 8"}, 14, id="a flow mapping left open"),
    pytest.param({14: "  path: 'data.jsonl"}, 14, id="a quote left open"),
    pytest.param({14: "  template: alpaca: x"}, 14, id="a colon inside a plain value"),
])
def test_a_yaml_error_names_the_line_to_fix(tmp_path, lines, line):
    """The parser notices an unfinished key, bracket or quote on a later line; the message names the line to fix."""
    text = [f"# line {n}" for n in range(1, 21)]
    text[12:17] = ["data:", "  format: instruction", "federation:", "  num_clients: 2", "  rounds: 1"]
    for n, replaced in lines.items():
        text[n - 1] = replaced
    path = tmp_path / "recipe.yaml"
    path.write_text("\n".join(text) + "\n")
    with pytest.raises(RecipeError, match=rf"<yaml> line {line}, column \d+: got .*; expected valid YAML") as e:
        load_recipe(path)
    assert f"line {line + 1}," not in str(e.value)


def test_local_steps_xor_epochs():
    with pytest.raises(RecipeError, match="exactly one of train.local_steps"):
        parse_recipe({"data": {"path": "x"}, "train": {}})


@pytest.mark.parametrize("path", sorted((ROOT / "recipes").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_recipe_loads_and_names_its_command(path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and ("fedllm train" in first or "accelerate launch" in first), first
    assert str(path.relative_to(ROOT)) in first
    load_recipe(path)
    yaml.safe_load(path.read_text())


def test_the_c_parser_and_emitter_read_and_write_what_pure_python_pyyaml_does():
    """dump_recipe (a run's recipe.yaml, a checkpoint's) runs on libyaml's C emitter and read_written_yaml, which reads
    such text back, on its C parser; PyYAML's pure-Python ones are the reference. Every shipped recipe resolves to the
    same recipe.yaml text and reads back to the same values; YAML the C parser refuses gets the pure-Python parser's
    error (its line, its words). Users' YAML stays on the pure-Python parser: it refuses a tab that libyaml takes."""
    from fedllm.recipe.schema import _Loader, dump_recipe, read_written_yaml, read_yaml

    assert yaml.__with_libyaml__  # PyYAML's wheels ship libyaml: the fast path is the one tested here
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        recipe = load_recipe(path)
        written = dump_recipe(recipe)
        assert written == yaml.safe_dump(recipe.to_dict(), sort_keys=False), path
        assert read_written_yaml(written) == yaml.load(written, Loader=_Loader) == recipe.to_dict(), path  # noqa: S506
    floats = "lr: 1e-3\nscale: 2E5\nplain: 0.5\nword: e5\n"
    assert read_written_yaml(floats) == read_yaml(floats) == {"lr": 1e-3, "scale": 2e5, "plain": 0.5, "word": "e5"}
    said = []
    for broken in ("a: 1\nb: 2\na: 3\n", "model: [unclosed\n", "a: 'open\nb: 2\n", "a:\n\t- 1\n"):
        with pytest.raises(yaml.YAMLError) as fast:
            read_written_yaml(broken)
        with pytest.raises(yaml.YAMLError) as pure:
            yaml.load(broken, Loader=_Loader)  # noqa: S506
        assert str(fast.value) == str(pure.value), broken
        said.append(str(fast.value))
    assert "duplicate key 'a' (line 3; first given on line 1)" in said[0]
    tabbed = "rounds: 5\t\n"
    assert read_written_yaml(tabbed) == {"rounds": 5}  # libyaml's reading
    with pytest.raises(yaml.YAMLError, match=r"found character '\\t' that cannot start any token"):
        read_yaml(tabbed)
