"""Run-directory faults: --overwrite never deletes what fedllm did not create; --resume never duplicates."""

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.commands.cli import main
from fedllm.engine.server import RunDirError, run
from fedllm.recipe.checks import parse_recipe
from fedllm.runs.rundir import RUN_MARKER


def _write_recipe(path, raw):
    path.write_text(yaml.safe_dump(raw))
    return path


def test_overwrite_refuses_a_directory_that_is_not_a_run(tiny_recipe, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "canary.txt").write_text("precious")
    recipe = _write_recipe(tmp_path / "r.yaml", tiny_recipe(output_dir=str(out)))
    assert main(["train", str(recipe), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert str(out) in err and "not a fedllm run directory" in err
    assert (out / "canary.txt").read_text() == "precious" and sorted(p.name for p in out.iterdir()) == ["canary.txt"]
    assert main(["train", str(recipe)]) == 2  # without the flag: refused too, the canary stays
    assert "not a fedllm run" in capsys.readouterr().err and (out / "canary.txt").exists()


def test_overwrite_refuses_the_current_directory_even_when_marked(tiny_recipe, tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"
    here.mkdir()
    (here / RUN_MARKER).write_text("{}")
    (here / "canary.txt").write_text("precious")
    monkeypatch.chdir(here)
    recipe = _write_recipe(tmp_path / "r.yaml", tiny_recipe(output_dir="."))
    assert main(["train", str(recipe), "--overwrite"]) == 2
    assert "current directory" in capsys.readouterr().err
    assert (here / "canary.txt").read_text() == "precious"
    with pytest.raises(RunDirError, match="current directory or one of its parents"):
        run(parse_recipe(tiny_recipe(output_dir=str(tmp_path))), overwrite=True)  # an ancestor of the cwd
    assert (here / "canary.txt").exists()


def test_overwrite_refuses_a_run_dir_holding_the_recipe_or_the_data(tiny_recipe, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_MARKER).write_text("{}")
    recipe = _write_recipe(out / "r.yaml", tiny_recipe(output_dir=str(out)))
    assert main(["train", str(recipe), "--overwrite"]) == 2
    assert f"it holds the recipe ({recipe})" in capsys.readouterr().err
    recipe.unlink()
    data = out / "data.jsonl"
    data.write_text(open(tiny_recipe()["data"]["path"]).read())
    with pytest.raises(RunDirError, match="it holds data.path"):
        run(parse_recipe(tiny_recipe(output_dir=str(out), data={"path": str(data)})), overwrite=True)
    assert data.exists() and (out / RUN_MARKER).exists()


def test_overwrite_replaces_a_finished_run(tiny_recipe):
    recipe = parse_recipe(tiny_recipe(federation={"rounds": 1}))
    first = run(recipe)
    assert (first.run_dir / RUN_MARKER).is_file()
    (first.run_dir / "eval").mkdir()
    (first.run_dir / "eval" / "stale.json").write_text("{}")
    second = run(recipe, overwrite=True)
    assert not (second.run_dir / "eval" / "stale.json").exists()
    assert [json.loads(x)["round"] for x in (second.run_dir / "metrics.jsonl").read_text().splitlines()] == [1]


def test_resume_without_a_checkpoint_starts_clean_and_never_duplicates_metrics(tiny_recipe, tmp_path, crash_at_round,
                                                                               caplog):
    clean = run(parse_recipe(tiny_recipe(output_dir=str(tmp_path / "clean"), federation={"rounds": 3})))
    recipe = parse_recipe(tiny_recipe(output_dir=str(tmp_path / "cut"), federation={"rounds": 3}))  # every: 0
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    metrics = tmp_path / "cut" / "metrics.jsonl"
    assert [json.loads(x)["round"] for x in metrics.read_text().splitlines()] == [1, 2]
    crash_at_round(None)
    with caplog.at_level("WARNING", logger="fedllm"):
        resumed = run(recipe, resume=True)
    assert "no checkpoint to resume from; starting from round 0" in caplog.text
    assert [json.loads(x)["round"] for x in metrics.read_text().splitlines()] == [1, 2, 3]  # not 1, 2, 1, 2, 3
    a, b = load_file(str(clean.run_dir / "final" / "adapter.safetensors")), load_file(
        str(resumed.run_dir / "final" / "adapter.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the clean restart is the same run


def test_resume_refuses_a_directory_that_is_not_a_run(tiny_recipe, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "canary.txt").write_text("precious")
    with pytest.raises(RunDirError, match="not a fedllm run directory"):
        run(parse_recipe(tiny_recipe(output_dir=str(out))), resume=True)
    assert sorted(p.name for p in out.iterdir()) == ["canary.txt"]


def test_refusals_come_before_the_model_is_built(tiny_recipe, tmp_path, monkeypatch):
    import fedllm.engine.server as server

    out = tmp_path / "mine"
    out.mkdir()
    (out / "canary.txt").write_text("precious")
    monkeypatch.setattr(server, "build_federation", lambda recipe: pytest.fail("built the model first"))
    for flags in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(RunDirError):
            run(parse_recipe(tiny_recipe(output_dir=str(out))), **flags)
