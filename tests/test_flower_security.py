"""Secure by default, on the session's shared deployment (tests/flower_cluster.py: a TLS SuperLink from
``fedllm flower certs`` with SuperNode authentication, fedllm's ServerApp runner and node workers;
``pytest -k flower_security``). Everything this module needs is started at once by its first test.

- an app that is not fedllm's, submitted with ``flwr run``, runs nowhere (no code of it runs, the run fails
  with the refusal);
- fedllm's own app submitted with a run config the operator did not sign (a file that is no recipe, an output_dir
  of the submitter's choosing) runs nowhere either, and no word of that file reaches the run's log; a signed run
  whose output_dir lies outside the SuperLink's ``--runs-dir`` is refused (exit 2) and writes nothing;
- a SuperNode whose key was not registered never joins; one that does not trust the CA never connects;
- one run (3 rounds) through every disruption a node may meet: a registered SuperNode claiming client 0 with
  another client's key is refused (the run goes on); node 1's worker is killed with ``kill -9`` in the middle
  of a round-2 message (``fedllm flower supernode`` restarts it and the new worker answers that message from
  its journal); node 1 is killed with ``kill -9`` (all its processes) after round 2 and restarted at once with
  its state directory (the SuperLink still counts its old session online: the node, whose old process is gone,
  ends that session itself and joins at once, instead of being refused for 2 x 30 s), then continues; client 2
  is served by a ``--no-worker`` SuperNode (Flower's own ClientApp process per message). The run equals the
  simulation.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from flower_cluster import (  # noqa: F401
    assert_matches,
    children,
    deployment,
    finished_status,
    launch,
    logged,
    stop,
    wait_until,
    worker_pid,
)

pytest.importorskip("flwr")

from fedllm.engine.server import run  # noqa: E402
from fedllm.flower import APP_DIR, reach  # noqa: E402
from fedllm.flower.certs import write_certificates, write_node_keys  # noqa: E402
from fedllm.recipe.checks import parse_recipe  # noqa: E402

FOREIGN_APP = '''
from pathlib import Path
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp

app = ServerApp()
client = ClientApp()


@app.main()
def main(grid, context):
    Path(context.run_config["marker"], "server-ran").write_text("mallory was here")


@client.train()
def train(msg, context):
    Path(context.run_config["marker"], "client-ran").write_text("mallory was here")
'''

FOREIGN_PROJECT = '''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "foreign"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "mallory"

[tool.flwr.app.components]
serverapp = "foreign_app:app"
clientapp = "foreign_app:client"

[tool.flwr.app.config]
marker = ""
'''

DISRUPTED = "test_flower_security_second_claim_refused_and_restarted_node_rejoins"
NEEDS_DISRUPTED = {DISRUPTED, "test_worker_killed_with_kill_9_mid_message_recovers",
                   "test_no_worker_supernode_serves_its_client_and_matches_the_simulation"}


@pytest.fixture
def started(deployment, launch, tiny_recipe, tmp_path_factory, request):  # noqa: F811
    """What this module's tests wait on, all started by the first test that asks (name -> process or run)."""
    if not launch.begin(request):
        return launch.items
    where = launch.items["where"] = tmp_path_factory.mktemp("security")
    if "test_flower_security_foreign_app_runs_nowhere" in launch.wanted:
        app = where / "foreign"
        app.mkdir()
        (app / "foreign_app.py").write_text(FOREIGN_APP)
        (app / "pyproject.toml").write_text(FOREIGN_PROJECT)
        with open(where / "foreign.json", "w") as out:
            launch.procs.append(subprocess.Popen(
                [str(Path(sys.executable).parent / "flwr"), "run", str(app), "fedllm", "--run-config",
                 f"marker='{where}'", "--format", "json"], stdout=out, stderr=subprocess.STDOUT, env=deployment.env))
    if "test_flower_security_unsigned_run_config_is_refused_before_any_file_is_read" in launch.wanted:
        # a CA-cert holder who reaches the Control API (here: on the SuperLink's machine) submits fedllm's own app
        # with a config of its choosing: a file that is no recipe, an output_dir of its choosing
        (where / "secret.yaml").write_text("password: hunter2\napi_key: sk-0123456789\n")
        with open(where / "unsigned.json", "w") as out:
            launch.procs.append(subprocess.Popen(
                [str(Path(sys.executable).parent / "flwr"), "run", str(APP_DIR), "fedllm", "--run-config",
                 f"recipe='{where / 'secret.yaml'}' overrides='output_dir={where / 'evil'}'", "--format", "json"],
                stdout=out, stderr=subprocess.STDOUT, env=deployment.env))
    if "test_flower_security_signed_run_may_write_only_inside_the_runs_dir" in launch.wanted:
        outside = deployment.runs_dir.parent / f"fedllm-outside-{os.getpid()}-{where.name}"
        launch.items["outside"] = (outside, deployment.submit("outside", tiny_recipe(), where, out=outside))
    if "test_flower_security_unregistered_or_untrusting_node_is_refused" in launch.wanted:
        write_node_keys(where / "stranger", 1)
        write_certificates(where / "other", ["127.0.0.1"])
        launch.items["stranger"] = deployment.node(5, "stranger", where / "stranger-state",
                                                   key=where / "stranger" / "client-0.key", logs=where)
        launch.items["untrusting"] = deployment.node(6, "untrusting", where / "untrusting-state", key=deployment.key(3),
                                                     ca=where / "other" / "ca.crt", logs=where)
    if launch.wanted & NEEDS_DISRUPTED:
        # client 2 on a --no-worker SuperNode (key 2); an intruder claiming client 0 with client 3's key
        launch.items["plain"] = deployment.node(2, "node2-plain", where / "node2", "--no-worker", logs=where)
        intruder = deployment.node(0, "intruder", where / "intruder", key=deployment.key(3), logs=where)
        launch.items["intruder"] = intruder
        wait_until(lambda: logged(where / "intruder.log", "SuperNode ID"), 600, "intruder joined",
                   where / "intruder.log")
        # node 1's worker stops itself (SIGSTOP) at its round-2 message, received and journaled, not yet answered
        launch.items["stopped"] = deployment.stop_at(1, 2)
        raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 3, "rounds": 3, "strategy": "scaffold"},
                          train={"local_steps": 6, "batch_size": 4, "lr": 1e-2, "max_length": 64})
        launch.items["disrupted"] = deployment.submit("disrupted", raw, where)
    return launch.items


def refused(deployment, line: str) -> None:  # noqa: F811
    """Wait for the SuperLink's terminal to print ``line`` (its ServerApp runner's refusal, told just before the run's
    status): a file read, where each look at the status (:func:`finished_status`) is a ``flwr`` process."""
    log = deployment.root / "superlink.log"
    wait_until(lambda: logged(log, line), 120, f"the SuperLink refusing: {line}", log)


def test_flower_security_foreign_app_runs_nowhere(started, deployment):  # noqa: F811
    where = started["where"]
    wait_until(lambda: "run-id" in (where / "foreign.json").read_text(), 120, "foreign run submitted",
               where / "foreign.json")
    text = (where / "foreign.json").read_text()
    run_id = str(json.loads(text[text.index("{"):])["run-id"])
    refused(deployment, "app 'mallory/foreign' refused")
    status = finished_status(deployment.env, run_id, 120)
    assert status["status"] == "finished:failed", status
    assert "refused" in status.get("status-details", "") and "mallory/foreign" in status["status-details"]
    assert not (where / "server-ran").exists() and not (where / "client-ran").exists()


def test_flower_security_unsigned_run_config_is_refused_before_any_file_is_read(started, deployment):  # noqa: F811
    where = started["where"]
    wait_until(lambda: "run-id" in (where / "unsigned.json").read_text(), 120, "unsigned run submitted",
               where / "unsigned.json")
    text = (where / "unsigned.json").read_text()
    run_id = str(json.loads(text[text.index("{"):])["run-id"])
    refused(deployment, "run refused: its run config is not signed")
    status = finished_status(deployment.env, run_id, 120)
    assert status["status"] == "finished:failed", status
    assert "not signed with this SuperLink operator's key" in status.get("status-details", ""), status
    log = subprocess.run([str(Path(sys.executable).parent / "flwr"), "log", run_id, "fedllm", "--show"],
                         capture_output=True, text=True, env=deployment.env, timeout=120)
    assert "not signed" in log.stdout + log.stderr
    for leak in ("hunter2", "sk-0123456789", "password", "api_key"):
        assert leak not in log.stdout + log.stderr + json.dumps(status), leak
    assert not (where / "evil").exists()


def test_flower_security_signed_run_may_write_only_inside_the_runs_dir(started):
    outside, run_ = started["outside"]
    rc = run_.wait(300)
    out = run_.log.read_text()
    assert rc == 2, out[-3000:]
    assert f"output_dir={outside}: outside" in out and "--runs-dir" in out
    assert not outside.exists()


def test_flower_security_unregistered_or_untrusting_node_is_refused(started):
    where = started["where"]
    # Flower's SuperNode gives up (exit code 305) on a key the SuperLink does not know and on a certificate its CA
    # did not sign: no fixed sleep, the refusal itself is the signal
    for name, why in (("stranger", "Failed to activate SuperNode"), ("untrusting", "CERTIFICATE_VERIFY_FAILED")):
        log = where / f"{name}.log"
        wait_until(lambda node=started[name]: node.poll() is not None, 120, f"{name} SuperNode refused", log)
        assert logged(log, why) and not logged(log, "SuperNode ID"), log.read_text()[-2000:]
    assert logged(where / "stranger.log", reach.REFUSALS["unknown"])  # the cause, as the SuperLink tells it


def disrupted(started, deployment, tmp_path):  # noqa: F811
    """Drive the disrupted run (once per module): kill -9 of node 1's worker mid round 2 (stopped where its
    round-2 message is received and journaled, its reply not sent), node 1 restarted after round 2. Returns
    ``(run, simulation run dir, pid of the killed worker, pid of its successor)``."""
    if "result" in started:
        return started["result"]
    run_ = started["disrupted"]
    journal = deployment.states[1] / ".worker-1.inflight"
    metrics = run_.out / "metrics.jsonl"

    def rounds() -> int:
        return metrics.read_text().count("\n") if metrics.is_file() else 0

    stopped = started["stopped"]  # node 1's worker stopped itself mid-message (tests/worker_hooks/sitecustomize.py)
    wait_until(stopped.is_file, 600, "node 1's worker stopped at its round-2 message", deployment.logs[1], every_s=0.1)
    victim = int(stopped.read_text())
    assert victim == worker_pid(deployment.nodes[1]) and journal.is_file() and rounds() < 2
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: worker_pid(deployment.nodes[1]) not in (None, victim), 120, "node 1's worker restarted",
               deployment.logs[1])
    successor = worker_pid(deployment.nodes[1])
    killed_log = deployment.logs[1]
    wait_until(lambda: rounds() >= 2, 600, "round 2", run_.log, every_s=0.1)
    node = deployment.nodes[1]  # node 1's machine crashes: kill -9 of every process of the node at once ...
    for pid in [node.pid, *children(node.pid)]:
        os.kill(pid, signal.SIGKILL)
    node.wait()
    deployment.serve(1, "node1-restarted")  # ... and it restarts at once, same state directory
    sim = run(parse_recipe({**run_.raw, "output_dir": str(tmp_path / "sim")})).run_dir
    run_.finish()
    started["result"] = (run_, sim, victim, successor, killed_log)
    return started["result"]


def history_of(run_) -> list[dict]:
    return [json.loads(x) for x in (run_.out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_worker_killed_with_kill_9_mid_message_recovers(started, deployment, tmp_path):  # noqa: F811
    """``kill -9`` of node 1's worker while it answers a message: ``fedllm flower supernode`` restarts it, the new
    worker answers that message (same task) from its journal and the node's state, and the run equals the
    simulation."""
    run_, sim, victim, successor, killed_log = disrupted(started, deployment, tmp_path)
    assert logged(killed_log, "node worker exited with code -9; restarting it")
    assert logged(killed_log, "interrupted when the previous worker stopped")
    assert successor not in (None, victim)
    assert all("dropped" not in h for h in history_of(run_))
    assert_matches(sim, run_.out, ["adapter"], "scaffold with a killed worker")


@pytest.mark.slow
def test_flower_security_second_claim_refused_and_restarted_node_rejoins(started, deployment, tmp_path):  # noqa: F811
    """A registered node claiming client 0 with client 3's key is refused (the run goes on); node 1, killed with
    ``kill -9`` (every process of it) after round 2 and restarted at once with its state directory, finds the
    SuperLink still counting its old session online, ends that session itself (its process is gone:
    fedllm.flower.dead_session) instead of being refused until it times out, rejoins and serves round 3; the run
    equals the simulation."""
    run_, sim, *_ = disrupted(started, deployment, tmp_path)
    out = run_.log.read_text()
    assert "refused: it claims client 0 but did not authenticate with client 0's key" in out
    history = history_of(run_)
    assert [h["clients"] for h in history] == [[0, 1, 2]] * 3 and all("dropped" not in h for h in history)
    assert logged(deployment.logs[1], "SuperNode ID")  # the restarted node
    assert logged(deployment.logs[1], reach.PREVIOUS_SESSION)  # the cause, as the SuperLink tells it
    assert logged(deployment.logs[1], "is gone: ended that session")  # ended by the node itself ...
    assert not logged(deployment.logs[1], "Failed to activate SuperNode")  # ... before Flower's SuperNode started
    assert_matches(sim, run_.out, ["adapter"], "scaffold with a restarted node")


@pytest.mark.slow
def test_no_worker_supernode_serves_its_client_and_matches_the_simulation(started, deployment, tmp_path):  # noqa: F811
    """Client 2's SuperNode runs with ``--no-worker``: Flower starts fedllm's ClientApp in a new process for each
    message, which rebuilds the node from the recipe and the state directory; the run equals the simulation."""
    run_, sim, *_ = disrupted(started, deployment, tmp_path)
    where = started["where"]
    assert worker_pid(started["plain"]) is None and not logged(where / "node2-plain.log", "fedllm worker")
    assert max(p.name for p in (where / "node2").glob("*/client-2/step-*")) == "step-0003"
    assert [h["clients"] for h in history_of(run_)] == [[0, 1, 2]] * 3
    assert_matches(sim, run_.out, ["adapter"], "scaffold with a --no-worker SuperNode")
