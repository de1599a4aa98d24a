"""A real Flower deployment on 127.0.0.1: one SuperLink and two SuperNodes as subprocesses (insecure mode),
three recipes submitted with ``fedllm flower run``; the final global adapter (and FRLoRA's base, on the
server and on both nodes) equals the in-process simulation of the same recipe and seed.

Tolerance: 1e-6 max abs difference (the same code and seeds run on both sides; in practice the tensors
are bit-identical). Bounded: every process has a deadline and is killed with its process group at the end.

Flower starts a fresh ClientApp process (torch + transformers imports, model build) for every message, so
the three runs take 2.5 min on a 2-core machine at load 5 and 8-9 min on a saturated one: the test is
marked ``slow`` (CI runs it; ``-m "not slow"`` skips it locally). tests/test_flower_apps.py runs the same
code paths in process in seconds.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml
from safetensors.torch import load_file

pytest.importorskip("flwr")

from fedllm.base_history import load_base  # noqa: E402
from fedllm.config import parse_recipe  # noqa: E402
from fedllm.server import run  # noqa: E402

DEADLINE_S = 600  # for the three runs together, on a busy 2-core machine; ~1 min on an idle one


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, log_path, env):
    """A fedllm command in its own process group (so its Flower children are stopped with it)."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "fedllm", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def federation(tmp_path):
    """``(superlink address, env, state dirs)`` of a running SuperLink with two SuperNodes (clients 0 and 1)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr-home"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    port = free_port()
    address = f"127.0.0.1:{port}"
    procs = [start(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port)],
                   tmp_path / "superlink.log", env)]
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, (tmp_path / "superlink.log").read_text()[-3000:]
                time.sleep(0.3)
        states = [tmp_path / f"node{i}" for i in range(2)]
        for i, state in enumerate(states):
            procs.append(start(["flower", "supernode", "--superlink", address, "--client", str(i), "--insecure",
                                "--state-dir", str(state), "--port", str(free_port())],
                               tmp_path / f"supernode{i}.log", env))
        yield address, env, states
    finally:
        for proc in reversed(procs):
            stop(proc)


CASES = {  # strategy, clients per round (of 2), extra run options
    "fedavg": ("fedavg", 2, ["--probe-mb", "9"]),  # + a 9 MB tensor to each node: over gRPC's 4 MiB default
    "frlora": ("frlora", 1, []),  # one client per round: the other catches up (and both sync at the end)
    "scaffold": ("scaffold", 2, []),
}


@pytest.mark.slow
def test_flower_deployment_matches_the_simulation(federation, tiny_recipe, tmp_path):
    address, env, states = federation
    runs, sims = {}, {}
    for name, (strategy, per_round, options) in CASES.items():
        raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": per_round, "rounds": 2,
                                      "strategy": strategy})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**raw, "output_dir": str(tmp_path / f"flower-{name}")}))
        runs[name] = start(["flower", "run", str(path), "--superlink", address, "--insecure", "--timeout", "500",
                            *options], tmp_path / f"run-{name}.log", env)
        sims[name] = raw
    try:
        for name, raw in sims.items():  # the in-process simulations run meanwhile
            sims[name] = run(parse_recipe({**raw, "output_dir": str(tmp_path / f"sim-{name}")})).run_dir
        deadline = time.monotonic() + DEADLINE_S
        for name, proc in runs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name}: no result within {DEADLINE_S}s; log:\n"
                            + (tmp_path / f"run-{name}.log").read_text()[-3000:])
            assert rc == 0, (tmp_path / f"run-{name}.log").read_text()[-3000:]
    finally:
        for proc in runs.values():
            stop(proc)
    for name, sim_dir in sims.items():
        flower_dir = tmp_path / f"flower-{name}"
        assert (flower_dir / "final" / "adapter.safetensors").is_file(), \
            (tmp_path / f"run-{name}.log").read_text()[-3000:]
        parts = ["adapter", "base"] if name == "frlora" else ["adapter"]
        for part in parts:
            want = load_file(str(sim_dir / "final" / f"{part}.safetensors"))
            got = load_file(str(flower_dir / "final" / f"{part}.safetensors"))
            assert want.keys() == got.keys()
            worst = max(float((want[k] - got[k]).abs().max()) for k in want)
            assert worst <= 1e-6, f"{name} {part}: max abs difference {worst}"
        assert not (flower_dir / "final" / "clients.safetensors").exists()  # per-client state stays on the nodes
        sim_lines = [json.loads(x) for x in (sim_dir / "metrics.jsonl").read_text().splitlines()]
        got_lines = [json.loads(x) for x in (flower_dir / "metrics.jsonl").read_text().splitlines()]
        assert [x["train_loss"] for x in got_lines] == pytest.approx([x["train_loss"] for x in sim_lines], abs=1e-6)
    want_base = load_file(str(sims["frlora"] / "final" / "base.safetensors"))
    for state in states:  # both nodes, participating or not, end with the server's base W^T
        step = sorted(state.glob("*/client-*/step-*"))
        node_base = {}
        for s in step:
            if (s / "base.safetensors").is_file():
                node_base = load_base(s)  # the snapshot with the log of merges since it replayed
        assert node_base.keys() == want_base.keys()
        assert max(float((want_base[k] - node_base[k]).abs().max()) for k in want_base) <= 1e-6
    kept = [load_file(str(p)) for s in states for p in s.glob("*/client-*/step-*/clients.safetensors")]
    assert kept and all(k.startswith("client") for st in kept for k in st)  # SCAFFOLD's c_i, on the nodes only


def test_flower_tls_supernode_connects_with_the_ca_and_not_without(tmp_path):
    """``fedllm flower certs`` + ``superlink --certificates``: a SuperNode holding the CA registers over TLS; one
    that does not trust the CA (system roots only) never does."""
    from fedllm.flower.certs import write_certificates

    write_certificates(tmp_path / "certs", ["127.0.0.1", "localhost"])
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home")}
    port = free_port()
    procs = [start(["flower", "superlink", "--certificates", str(tmp_path / "certs"), "--host", "127.0.0.1",
                    "--port", str(port)], tmp_path / "superlink.log", env)]
    try:
        for name, trust in (("trusted", ["--root-certificates", str(tmp_path / "certs" / "ca.crt")]),
                            ("untrusted", ["--root-certificates", str(tmp_path / "other.crt")])):
            if name == "untrusted":  # a CA the server certificate was not signed by
                write_certificates(tmp_path / "other", ["127.0.0.1"])
                (tmp_path / "other.crt").write_bytes((tmp_path / "other" / "ca.crt").read_bytes())
            procs.append(start(["flower", "supernode", "--superlink", f"127.0.0.1:{port}", "--client", "0",
                                "--state-dir", str(tmp_path / name), "--port", str(free_port()), *trust],
                               tmp_path / f"{name}.log", env))
        deadline = time.monotonic() + 120
        while "SuperNode ID" not in (tmp_path / "trusted.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "trusted.log").read_text()[-3000:]
            time.sleep(0.5)
        time.sleep(3)
        assert "SuperNode ID" not in (tmp_path / "untrusted.log").read_text()
    finally:
        for proc in reversed(procs):
            stop(proc)


def test_flower_run_exits_1_when_the_server_app_fails(tiny_recipe, tmp_path):
    """``fedllm flower run`` reports the SuperLink's verdict: a ServerApp that raises (here: the run directory
    already holds a run and neither --resume nor --overwrite was given) gives exit code 1, not 0."""
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "flwr-home"), "HF_HUB_OFFLINE": "1"}
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "metrics.jsonl").write_text('{"round": 1}\n')
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**tiny_recipe(), "output_dir": str(taken)}))
    port = free_port()
    link = start(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port)],
                 tmp_path / "superlink.log", env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        proc = subprocess.run([sys.executable, "-m", "fedllm", "flower", "run", str(path), "--superlink",
                               f"127.0.0.1:{port}", "--insecure", "--timeout", "60"], env=env, capture_output=True,
                              text=True, timeout=300)
    finally:
        stop(link)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "finished:failed" in proc.stderr
    assert (taken / "metrics.jsonl").read_text() == '{"round": 1}\n'  # nothing of the old run was touched
