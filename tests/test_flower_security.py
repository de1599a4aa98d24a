"""Secure by default: a TLS SuperLink from ``fedllm flower certs`` with SuperNode authentication, fedllm's
ServerApp runner and node workers, for the whole module (``pytest -k flower_security``).

- an app that is not fedllm's, submitted with ``flwr run``, runs nowhere (no code of it runs, the run fails
  with the refusal);
- a SuperNode whose key was not registered never joins; one that does not trust the CA never connects;
- a registered SuperNode claiming a client id that another node serves (and whose key is not that client's)
  is refused, and the run goes on to the end;
- a SuperNode restarted with its state directory intact is sampled again and continues: the run equals the
  simulation.
"""

import json
import signal
import subprocess
import sys
import time

import pytest
import yaml
from flower_cluster import (env_for, free_port, logged, port_open, run_status, start, stop, wait_until,
                            write_flwr_home)
from safetensors.torch import load_file

pytest.importorskip("flwr")

from fedllm.config import parse_recipe  # noqa: E402
from fedllm.flower.certs import write_certificates, write_node_keys  # noqa: E402
from fedllm.server import run  # noqa: E402

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


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """``(address, env, certs dir, {client: SuperNode process}, logs dir)``: a TLS SuperLink with node auth and
    the SuperNodes of clients 0 and 1 (keys of clients 0, 1 and 2 registered)."""
    logs = tmp_path_factory.mktemp("secure")
    certs = logs / "certs"
    write_certificates(certs, ["127.0.0.1"], clients=3)
    env = env_for(logs / "flwr-home")
    port = free_port()
    address = f"127.0.0.1:{port}"
    write_flwr_home(logs / "flwr-home", address, certs / "ca.crt")
    procs = [start(["flower", "superlink", "--certificates", str(certs), "--host", "127.0.0.1", "--port", str(port)],
                   logs / "superlink.log", env)]
    nodes = {}
    try:
        wait_until(lambda: port_open(port) and logged(logs / "superlink.log", "client-2.pub registered"), 180,
                   "SuperLink with node keys registered", logs / "superlink.log")
        for cid in range(2):
            nodes[cid] = node(address, cid, certs / "nodes" / f"client-{cid}.key", logs, env, certs)
        procs += list(nodes.values())
        yield address, env, certs, nodes, logs
    finally:
        for proc in reversed(procs + list(nodes.values())):
            stop(proc)


def node(address, cid, key, logs, env, certs, name=None):
    name = name or f"node{cid}"
    return start(["flower", "supernode", "--superlink", address, "--client", str(cid), "--root-certificates",
                  str(certs / "ca.crt"), "--auth-key", str(key), "--state-dir", str(logs / name), "--port",
                  str(free_port())], logs / f"{name}.log", env)


def test_flower_security_foreign_app_runs_nowhere(secure, tmp_path):
    _, env, _, _, _ = secure
    app = tmp_path / "foreign"
    app.mkdir()
    (app / "foreign_app.py").write_text(FOREIGN_APP)
    (app / "pyproject.toml").write_text('''[build-system]
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
''')
    out = subprocess.run([str(__import__("pathlib").Path(sys.executable).parent / "flwr"), "run", str(app), "fedllm",
                          "--run-config", f"marker='{tmp_path}'", "--format", "json"],
                         capture_output=True, text=True, env=env, timeout=120)
    run_id = str(json.loads(out.stdout[out.stdout.index("{"):])["run-id"])
    wait_until(lambda: run_status(env, run_id).get("status", "").startswith("finished"), 120, "foreign run to end")
    status = run_status(env, run_id)
    assert status["status"] == "finished:failed", status
    assert "refused" in status.get("status-details", "") and "mallory/foreign" in status["status-details"]
    assert not (tmp_path / "server-ran").exists() and not (tmp_path / "client-ran").exists()


def test_flower_security_unregistered_or_untrusting_node_is_refused(secure, tmp_path):
    address, env, certs, _, logs = secure
    write_node_keys(tmp_path / "stranger", 1)
    write_certificates(tmp_path / "other", ["127.0.0.1"])
    procs = [node(address, 5, tmp_path / "stranger" / "client-0.key", tmp_path, env, certs, name="stranger"),
             start(["flower", "supernode", "--superlink", address, "--client", "6", "--root-certificates",
                    str(tmp_path / "other" / "ca.crt"), "--auth-key", str(certs / "nodes" / "client-2.key"),
                    "--state-dir", str(tmp_path / "untrusting"), "--port", str(free_port())],
                   tmp_path / "untrusting.log", env)]
    try:
        # a registered node joins within seconds on this federation (see the fixture); give these 15 s
        time.sleep(15)
        for name in ("stranger", "untrusting"):
            assert not logged(tmp_path / f"{name}.log", "SuperNode ID"), (tmp_path / f"{name}.log").read_text()[-2000:]
    finally:
        for proc in procs:
            stop(proc)


def submit(name, raw, secure, tmp_path):
    address, env, certs, _, _ = secure
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**raw, "output_dir": str(tmp_path / f"flower-{name}")}))
    return start(["flower", "run", str(path), "--superlink", address, "--root-certificates", str(certs / "ca.crt"),
                  "--timeout", "600"], tmp_path / f"run-{name}.log", env)


@pytest.mark.slow
def test_flower_security_second_claim_refused_and_restarted_node_rejoins(secure, tiny_recipe, tmp_path):
    """One run: a registered node claiming client 0 with client 2's key is refused (the run goes on); node 1,
    stopped after round 1 and restarted with its state directory, continues; the run equals the simulation."""
    address, env, certs, nodes, logs = secure
    intruder = node(address, 0, certs / "nodes" / "client-2.key", tmp_path, env, certs, name="intruder")
    wait_until(lambda: logged(tmp_path / "intruder.log", "SuperNode ID"), 120, "intruder joined",
               tmp_path / "intruder.log")
    raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 3, "strategy": "scaffold"})
    proc = submit("rejoin", raw, secure, tmp_path)
    metrics = tmp_path / "flower-rejoin" / "metrics.jsonl"
    try:
        wait_until(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, 600, "round 1",
                   tmp_path / "run-rejoin.log", every_s=0.1)
        stop(nodes[1])  # node 1's machine restarts ...
        nodes[1] = node(address, 1, certs / "nodes" / "client-1.key", logs, env, certs)  # ... same state dir
        sim = run(parse_recipe({**raw, "output_dir": str(tmp_path / "sim")})).run_dir
        assert proc.wait(timeout=900) == 0, (tmp_path / "run-rejoin.log").read_text()[-3000:]
    finally:
        stop(proc, signal.SIGTERM)
        stop(intruder)
    out = (tmp_path / "run-rejoin.log").read_text()
    assert "refused: it claims client 0 but did not authenticate with client 0's key" in out
    history = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [h["clients"] for h in history] == [[0, 1]] * 3 and all("dropped" not in h for h in history)
    want, got = (load_file(str(d / "final" / "adapter.safetensors")) for d in (sim, tmp_path / "flower-rejoin"))
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
