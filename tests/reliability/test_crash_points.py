"""Every crash point is resumable: a torn last metrics line, a kill between final/ and summary.json, temporaries
of interrupted writes; and --resume continues the run on disk, not another recipe."""

import json
import shutil

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.commands.cli import main
from fedllm.engine.server import RunDirError, run
from fedllm.recipe.checks import parse_recipe
from tests.conftest import plot_png


def _rounds(run_dir):
    return [json.loads(x).get("round") for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _adapter(path):
    return load_file(str(path / "final" / "adapter.safetensors"))


def test_a_torn_last_metrics_line_and_stale_temporaries_do_not_stop_resume(run_copy, finished_run, caplog):
    run_dir, raw = run_copy
    shutil.rmtree(run_dir / "final")  # killed in round 3: round-0002 is the newest checkpoint
    (run_dir / "summary.json").unlink()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"round": 4, "cl')  # a write cut off by the kill
    (run_dir / ".final.tmp-x1y2").mkdir()
    (run_dir / ".final.tmp-x1y2" / "adapter.safetensors").write_bytes(b"half")
    (run_dir / "checkpoints" / ".round-0003.tmp-abc").mkdir()
    (run_dir / ".metrics.jsonl.k3j4").write_text("{}")
    (run_dir / ".my-notes").write_text("not fedllm's")
    with caplog.at_level("WARNING", logger="fedllm"):
        run(parse_recipe(raw), resume=True)
    assert "metrics.jsonl:4: torn last line (JSONDecodeError) left out" in caplog.text
    assert _rounds(run_dir) == [1, 2, 3]
    a, b = _adapter(finished_run[0]), _adapter(run_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-exact, as without the torn line
    assert not list(run_dir.glob(".final.tmp-*")) and not list(run_dir.glob(".metrics.jsonl.*"))
    assert not list((run_dir / "checkpoints").glob(".round-*"))
    assert (run_dir / ".my-notes").read_text() == "not fedllm's"  # only fedllm's temporaries are removed


def test_a_damaged_metrics_line_before_the_last_is_named(run_copy, tmp_path, capsys):
    run_dir, raw = run_copy
    shutil.rmtree(run_dir / "final")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("\n".join(["{oops", *lines[1:]]) + "\n")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    assert main(["train", str(recipe), "--resume"]) == 2
    assert f"{run_dir / 'metrics.jsonl'}:1: not a JSON record" in capsys.readouterr().err


def test_a_kill_between_final_and_summary_is_completed_by_resume(run_copy, finished_run, capsys, tmp_path):
    run_dir, raw = run_copy
    want = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").unlink()
    (run_dir / "plot.png").unlink(missing_ok=True)
    final_mtime = (run_dir / "final" / "adapter.safetensors").stat().st_mtime_ns
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    with plot_png():
        assert main(["train", str(recipe), "--resume"]) == 0
    got = json.loads((run_dir / "summary.json").read_text())
    for key in ("rounds", "final_train_loss", "bytes_up_total", "bytes_down_total", "seconds", "final_eval"):
        assert got[key] == want[key], key
    assert (run_dir / "plot.png").is_file()
    assert (run_dir / "final" / "adapter.safetensors").stat().st_mtime_ns == final_mtime  # final/ not rewritten
    assert _rounds(run_dir) == [1, 2, 3]
    assert main(["train", str(recipe), "--resume"]) == 2  # now finished: nothing to resume
    assert "already finished" in capsys.readouterr().err


def test_resume_refuses_a_recipe_that_changes_the_result_listing_each_key(run_copy, tmp_path, capsys):
    run_dir, raw = run_copy
    shutil.rmtree(run_dir / "final")
    before = (run_dir / "metrics.jsonl").read_text()
    changed = {**raw, "seed": 1, "lora": {**raw["lora"], "r": 8}, "train": {**raw["train"], "lr": 0.02},
               "federation": {**raw["federation"], "strategy": "fedprox", "num_clients": 4}}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(changed))
    assert main(["train", str(recipe), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "5 key(s) that change the result differ" in err
    for line in ("seed: the run has 0, the recipe gives 1", "lora.r: the run has 4, the recipe gives 8",
                 "train.lr: the run has 0.01, the recipe gives 0.02",
                 "federation.strategy: the run has 'fedavg', the recipe gives 'fedprox'",
                 "federation.num_clients: the run has 3, the recipe gives 4"):
        assert line in err, line
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert yaml.safe_load((run_dir / "recipe.yaml").read_text())["seed"] == 0  # recipe.yaml not rewritten
    with pytest.raises(RunDirError, match="federation.rounds=1, but .*round-0002 is of round 2"):
        run(parse_recipe({**raw, "federation": {**raw["federation"], "rounds": 1}}), resume=True)


def test_resume_allows_and_records_safe_changes(run_copy):
    run_dir, raw = run_copy
    (run_dir / "summary.json").unlink()  # resumes from final/ (round 3)
    safe = {**raw, "federation": {**raw["federation"], "rounds": 4, "on_client_error": "fail"},
            "checkpoint": {"every": 1, "keep_last": 1}, "eval": {"every": 2}}
    run(parse_recipe(safe), resume=True)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("round") for r in records] == [1, 2, 3, None, 4]
    assert records[3] == {"resumed_after_round": 3, "changed": {
        "checkpoint.keep_last": [None, 1], "eval.every": [0, 2], "federation.on_client_error": ["skip", "fail"],
        "federation.rounds": [3, 4]}}
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 4
    assert json.loads((run_dir / "final" / "meta.json").read_text())["round"] == 4
