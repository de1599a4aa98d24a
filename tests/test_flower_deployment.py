"""A real Flower deployment on 127.0.0.1: one ``fedllm flower superlink --insecure`` and two
``fedllm flower supernode`` (each with its fedllm node worker) for the whole module, serving every test here.

- several recipes submitted at once with ``fedllm flower run``: the final global adapter (and FRLoRA's base, on
  the server and on both nodes) equals the in-process simulation (max abs difference <= 1e-6; in practice
  bit-identical), with each worker building a run's federation once;
- a worker killed with ``kill -9`` in the middle of a message: restarted, it answers that message from its
  journal and state directory, and the run still equals the simulation;
- too few SuperNodes: the server reports what it has and needs and ``fedllm flower run`` exits 2;
  stopping ``fedllm flower run`` stops the run on the SuperLink; a failing ServerApp gives exit code 1;
- ``kill -9`` of ``fedllm flower supernode`` leaves none of its processes behind.

Bounded: every process has a deadline and is stopped with its process group at the end. On a 2-core machine
shared with other jobs the module takes a few minutes (``slow``).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from flower_cluster import (children, env_for, free_port, logged, port_open, run_status, start, stop, wait_until,
                            worker_pid, write_flwr_home)
from safetensors.torch import load_file

pytest.importorskip("flwr")

from fedllm.base_history import load_base  # noqa: E402
from fedllm.config import parse_recipe  # noqa: E402
from fedllm.server import run  # noqa: E402

DEADLINE_S = 900  # for the runs of one test together, on a busy 2-core machine


@pytest.fixture(scope="module")
def federation(tmp_path_factory):
    """``(address, env, supernode processes, state dirs, logs dir)``: a SuperLink and two SuperNodes (clients 0, 1)."""
    logs = tmp_path_factory.mktemp("flower")
    env = env_for(logs / "flwr-home")
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = [start(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port)],
                   logs / "superlink.log", env)]
    try:
        wait_until(lambda: port_open(port), 120, "SuperLink", logs / "superlink.log")
        states = [logs / f"node{i}" for i in range(2)]
        nodes = [start(["flower", "supernode", "--superlink", address, "--client", str(i), "--insecure",
                        "--state-dir", str(state), "--port", str(free_port()), "--warm-runs", "4"],
                       logs / f"supernode{i}.log", env) for i, state in enumerate(states)]
        procs += nodes
        write_flwr_home(logs / "flwr-home", address)
        yield address, env, nodes, states, logs
    finally:
        for proc in reversed(procs):
            stop(proc)


def submit(name, raw, federation, tmp_path, *options):
    address, env, _, _, _ = federation
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**raw, "output_dir": str(tmp_path / f"flower-{name}")}))
    return start(["flower", "run", str(path), "--superlink", address, "--insecure", "--timeout", "600", *options],
                 tmp_path / f"run-{name}.log", env)


def finish(runs, tmp_path):
    deadline = time.monotonic() + DEADLINE_S
    for name, proc in runs.items():
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name}: no result within {DEADLINE_S}s; log:\n" + (tmp_path / f"run-{name}.log").read_text()[-3000:])
        assert rc == 0, (tmp_path / f"run-{name}.log").read_text()[-3000:]


def assert_matches(sim_dir, flower_dir, parts, what):
    for part in parts:
        want = load_file(str(sim_dir / "final" / f"{part}.safetensors"))
        got = load_file(str(flower_dir / "final" / f"{part}.safetensors"))
        assert want.keys() == got.keys()
        worst = max(float((want[k] - got[k]).abs().max()) for k in want)
        assert worst <= 1e-6, f"{what} {part}: max abs difference {worst}"
    sim_lines = [json.loads(x) for x in (sim_dir / "metrics.jsonl").read_text().splitlines()]
    got_lines = [json.loads(x) for x in (flower_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["train_loss"] for x in got_lines] == pytest.approx([x["train_loss"] for x in sim_lines], abs=1e-6)


CASES = {  # strategy, clients per round (of 2), extra run options
    "fedavg": ("fedavg", 2, ["--probe-mb", "9"]),  # + a 9 MB tensor to each node: over gRPC's 4 MiB default
    "frlora": ("frlora", 1, []),  # one client per round: the other catches up (and both sync at the end)
    "scaffold": ("scaffold", 2, []),
    "pflmf": ("pflmf", 2, []),
}


@pytest.mark.slow
def test_flower_deployment_with_workers_matches_the_simulation(federation, tiny_recipe, tmp_path):
    _, _, nodes, states, logs = federation
    runs, sims = {}, {}
    for name, (strategy, per_round, options) in CASES.items():
        raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": per_round, "rounds": 2,
                                      "strategy": strategy})
        runs[name] = submit(name, raw, federation, tmp_path, *options)
        sims[name] = raw
    try:
        for name, raw in sims.items():  # the in-process simulations run meanwhile
            sims[name] = run(parse_recipe({**raw, "output_dir": str(tmp_path / f"sim-{name}")})).run_dir
        finish(runs, tmp_path)
    finally:
        for proc in runs.values():
            stop(proc)
    for name, sim_dir in sims.items():
        flower_dir = tmp_path / f"flower-{name}"
        assert_matches(sim_dir, flower_dir, ["adapter", "base"] if name == "frlora" else ["adapter"], name)
        assert not (flower_dir / "final" / "clients.safetensors").exists()  # per-client state stays on the nodes
    want_base = load_file(str(sims["frlora"] / "final" / "base.safetensors"))
    for state in states:  # both nodes, participating or not, end with the server's base W^T
        step = sorted(state.glob("*/client-*/step-*"))
        node_base = {}
        for s in step:
            if (s / "base.safetensors").is_file():
                node_base = load_base(s)  # the snapshot with the log of merges since it replayed
        assert node_base.keys() == want_base.keys()
        assert max(float((want_base[k] - node_base[k]).abs().max()) for k in want_base) <= 1e-6
    for i in range(2):  # each worker built each run's federation once, whatever the number of messages
        built = [line.split(" of run ")[1].split()[0] for line in (logs / f"supernode{i}.log").read_text().splitlines()
                 if "fedllm worker: built the federation of run" in line]
        assert len(built) >= len(CASES) and len(set(built)) == len(built), built


@pytest.mark.slow
def test_worker_killed_with_kill_9_mid_message_recovers(federation, tiny_recipe, tmp_path):
    """``kill -9`` of node 1's worker while it answers a message: ``fedllm flower supernode`` restarts it, the new
    worker answers that message (same task) from its journal and the node's state, and the run equals the
    simulation."""
    _, _, nodes, states, logs = federation
    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 3, "strategy": "scaffold"},
                      train={"local_steps": 6, "batch_size": 4, "lr": 1e-2, "max_length": 64})
    proc = submit("killed", raw, federation, tmp_path)
    try:
        journal = states[1] / ".worker-1.inflight"
        metrics = tmp_path / "flower-killed" / "metrics.jsonl"
        # in round 2 (after a first round, so the killed worker had state to come back to)
        wait_until(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1 and journal.is_file(), 600,
                   "node 1 answering a round-2 message", logs / "supernode1.log", every_s=0.05)
        victim = worker_pid(nodes[1])
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir
        finish({"killed": proc}, tmp_path)
    finally:
        stop(proc)
    assert logged(logs / "supernode1.log", "node worker exited with code -9; restarting it")
    assert logged(logs / "supernode1.log", "interrupted when the previous worker stopped")
    assert worker_pid(nodes[1]) not in (None, victim)
    history = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert all("dropped" not in h for h in history)
    assert_matches(sim, tmp_path / "flower-killed", ["adapter"], "scaffold with a killed worker")


@pytest.mark.slow
def test_flower_run_with_too_few_supernodes_reports_and_exits_2(federation, tiny_recipe, tmp_path):
    """3 clients, 2 SuperNodes: the server says every few seconds what it has and needs; after --wait-nodes
    ``fedllm flower run`` exits 2 naming the missing client."""
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 1})
    proc = submit("few", raw, federation, tmp_path, "--wait-nodes", "12")
    try:
        rc = proc.wait(timeout=300)
    finally:
        stop(proc)
    out = (tmp_path / "run-few.log").read_text()
    assert rc == 2, out[-3000:]
    assert "waiting" in out and "2 of 3 clients served (missing: [2])" in out
    assert "one SuperNode per client" in out


@pytest.mark.slow
def test_stopping_flower_run_stops_the_run_on_the_superlink(federation, tiny_recipe, tmp_path):
    _, env, _, _, logs = federation
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 1})
    proc = submit("stopped", raw, federation, tmp_path, "--wait-nodes", "300")
    log = tmp_path / "run-stopped.log"
    try:
        wait_until(lambda: logged(log, "waiting"), 240, "the server waiting for nodes", log)
        run_id = log.read_text().split("fedllm flower run: run ", 1)[1].split()[0]
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        stop(proc)
    wait_until(lambda: run_status(env, run_id).get("status", "").startswith("finished"), 60, "run stopped", log)
    assert run_status(env, run_id)["status"] == "finished:stopped"


def test_flower_run_exits_1_when_the_server_app_fails(federation, tiny_recipe, tmp_path):
    """A ServerApp that raises (here: the run directory already holds a run and neither --resume nor --overwrite
    was given) gives exit code 1, not 0, and nothing of the old run is touched."""
    address, env, _, _, _ = federation
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text('{"round": 1}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**tiny_recipe(), "output_dir": str(taken)}))
    proc = subprocess.run([sys.executable, "-m", "fedllm", "flower", "run", str(path), "--superlink", address,
                           "--insecure", "--timeout", "60"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "finished:failed" in proc.stderr
    assert (taken / "metrics.jsonl").read_text() == '{"round": 1}\n'


def test_kill_9_of_flower_supernode_leaves_no_process_behind(federation, tmp_path):
    address, env, _, _, _ = federation
    node = start(["flower", "supernode", "--superlink", address, "--client", "7", "--insecure", "--state-dir",
                  str(tmp_path / "state"), "--port", str(free_port())], tmp_path / "node.log", env)
    try:
        wait_until(lambda: worker_pid(node) is not None and any("flower-supernode" in c for c in map(
            __import__("flower_cluster").cmdline, children(node.pid))), 120, "SuperNode and worker", tmp_path / "node.log")
        family = children(node.pid)
        os.kill(node.pid, signal.SIGKILL)  # the command alone, not its process group
        node.wait()
        wait_until(lambda: not [p for p in family if os.path.exists(f"/proc/{p}")], 30,
                   f"every child of fedllm flower supernode gone ({family})")
    finally:
        stop(node)
