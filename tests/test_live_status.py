"""The operator's status of a run (`fedllm flower status`): what it reads from a run directory, what it leaves out,
the terminal form, refusals, and the live page rendered by headless Chromium (a real deployment's page is checked in
tests/test_flower_deployment.py)."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from fedllm.commands.cli import main
from fedllm.runs.live_status import format_status, run_status, write_federation
from fedllm.runs.rundir import mark_run_dir

SECRET = "hf_SECRETTOKEN123"


@pytest.fixture
def run_dir(tmp_path):
    """A Flower run at round 2 of 4: round 1 whole, round 2 with a late and a dropped client, ε under DP, a
    half-written third line, two of three SuperNodes serving."""
    run = tmp_path / "runs" / "flower-dp"
    run.mkdir(parents=True)
    recipe = {"federation": {"num_clients": 3, "rounds": 4, "strategy": "fedavg"},
              "data": {"path": f"https://user:{SECRET}@example.com/data.jsonl"}, "model": {"name": "/home/me/secret"}}
    (run / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    rounds = [{"round": 1, "clients": [0, 2], "bytes_up_total": 2 * 2**20, "bytes_down_total": 2**20,
               "train_loss": 0.75, "epsilon": 1.5, "seconds": 10.0, "client_loss": {"0": 0.7123, "2": 0.8456}},
              {"round": 2, "clients": [1], "late": [2], "dropped": [0], "bytes_up_total": 2**20,
               "bytes_down_total": 2**20, "train_loss": 0.5, "epsilon": 2.25, "seconds": 30.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds) + '{"round": 3, "cli')
    write_federation(run, {0: 101, 1: 102}, connected=3)
    assert not (run / "federation.json").exists()  # not yet a run directory fedllm marked: nothing written there
    mark_run_dir(run)
    write_federation(run, {0: 101, 1: 102}, connected=3)
    return run


def test_status_reads_the_rounds_nodes_eta_and_epsilon(run_dir):
    status = run_status(run_dir, now=time.time())
    assert (status["round"], status["rounds"], status["state"], status["strategy"]) == (2, 4, "running", "fedavg")
    assert status["eta_s"] == pytest.approx((10.0 + 30.0) / 2 * 2)  # mean round seconds x rounds left
    assert status["epsilon"] == 2.25 and status["bytes_up"] == 3 * 2**20 and status["bytes_down"] == 2 * 2**20
    assert (status["nodes"]["connected"], status["nodes"]["serving"]) == (3, 2)
    second = status["history"][1]
    assert (second["clients"], second["late"], second["dropped"], second["loss"]) == ([1], [2], [0], 0.5)


def test_status_holds_no_secret_and_no_per_client_loss(run_dir):
    """An allow-list: nothing of the recipe but the strategy and counts; no per-client loss even where the run
    directory has one."""
    text = json.dumps(run_status(run_dir))
    assert SECRET not in text and "example.com" not in text and "/home/me" not in text
    assert "0.7123" not in text and "0.8456" not in text and "client_loss" not in text


def test_a_finished_run_has_no_eta(run_dir):
    (run_dir / "summary.json").write_text("{}")
    status = run_status(run_dir)
    assert status["state"] == "finished" and status["eta_s"] is None


def test_terminal_status(run_dir, capsys):
    assert main(["flower", "status", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert out == format_status(run_status(run_dir)) + "\n"
    assert "round 2/4, running, ETA 40 s; SuperNodes: 3 connected, 2 of 3 clients served; epsilon spent 2.25" in out
    assert "[2]" in out and "[0]" in out  # round 2's late and dropped clients


def test_status_of_no_run_exits_2(tmp_path, capsys):
    (tmp_path / "runs" / "quickstart").mkdir(parents=True)
    assert main(["flower", "status", str(tmp_path / "runs" / "quickstartt")]) == 2
    assert "did you mean" in capsys.readouterr().err
    assert main(["flower", "status", str(tmp_path / "runs" / "quickstart")]) == 2
    assert "no run here (no recipe.yaml)" in capsys.readouterr().err


def test_the_page_in_headless_chromium(run_dir, tmp_path):
    """The page as a browser renders it: its script read /status.json and filled in the round and node count."""
    kit = pytest.importorskip("status_page_kit")
    if kit.CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    with kit.status_page(run_dir, tmp_path / "page.log") as url:
        page = kit.rendered(url)
    assert (page["round"], page["rounds"], page["nodes"], page["state"]) == ("2", "4", "3", "running")
    assert page["epsilon"] == "2.25" and page["serving"] == "2 of 3"
    assert SECRET not in page["dom"]
