"""A real Flower deployment on 127.0.0.1 (the session's shared one, tests/flower_cluster.py: a TLS SuperLink with
SuperNode authentication and two ``fedllm flower supernode`` with their node workers). Every run of this module is
submitted at once by its first test; each test then waits on its own.

- four recipes side by side with ``fedllm flower run``: the final global adapter (and FRLoRA's base, on the
  server and on both nodes) equals the in-process simulation (max abs difference <= 1e-6; in practice
  bit-identical), with each worker building a run's federation once, and no finished ServerApp left
  ``<defunct>`` under the SuperLink;
- too few SuperNodes: the server reports what it has and needs and ``fedllm flower run`` exits 2;
  stopping ``fedllm flower run`` stops the run on the SuperLink; a ServerApp refusing its input gives exit code 2;
- ``kill -9`` of ``fedllm flower supernode`` leaves none of its processes behind; ``kill`` of ``fedllm flower
  superlink`` neither, and a new one starts on the same port.

(The kill -9 of a worker in the middle of a message is in tests/test_flower_security.py, in the same run as a
node's restart.) Bounded: every process has a deadline and is stopped with its process group at the end.
"""

import json
import os
import signal
from pathlib import Path

import pytest
import yaml
from flower_cluster import (  # noqa: F401
    Run,
    assert_matches,
    children,
    cmdline,
    deployment,
    finished_status,
    free_port,
    launch,
    logged,
    port_open,
    run_status,
    start,
    stop,
    wait_until,
    worker_pid,
    write_flwr_home,
    zombies,
)
from safetensors.torch import load_file

pytest.importorskip("flwr")

from fedllm.engine.server import run  # noqa: E402
from fedllm.recipe.checks import parse_recipe  # noqa: E402
from fedllm.runs.base_history import load_base  # noqa: E402

CASES = {  # strategy, clients per round (of 2), extra run options
    "fedavg": ("fedavg", 2, ["--probe-mb", "9"]),  # + a 9 MB tensor to each node: over gRPC's 4 MiB default
    "frlora": ("frlora", 1, []),  # one client per round: the other catches up (and both sync at the end)
    "scaffold": ("scaffold", 2, []),
    "pflmf": ("pflmf", 2, []),
}


@pytest.fixture
def runs(deployment, launch, tiny_recipe, tmp_path_factory, request):  # noqa: F811
    """This module's runs (name -> :class:`Run`), all submitted by the first test that asks."""
    if launch.begin(request):
        where = tmp_path_factory.mktemp("deployment-runs")
        launch.items["offsets"] = {cid: deployment.logs[cid].stat().st_size for cid in deployment.logs}
        if {"test_flower_deployment_with_workers_matches_the_simulation",
                "test_status_page_of_a_deployment_run_in_headless_chromium"} & set(launch.wanted):
            for name, (strategy, per_round, options) in CASES.items():
                raw = tiny_recipe(federation={"num_clients": 2, "clients_per_round": per_round, "rounds": 2,
                                              "strategy": strategy})
                launch.items[name] = deployment.submit(name, raw, where, *options)
        if "test_flower_run_with_too_few_supernodes_reports_and_exits_2" in launch.wanted:
            raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 1})
            # the two nodes serve this module's other runs meanwhile: however long they take to say which client
            # they serve, their answer decides (the executor asks them again after --wait-nodes), not the clock
            launch.items["few"] = deployment.submit("few", raw, where, "--wait-nodes", "10")
        if "test_stopping_flower_run_stops_the_run_on_the_superlink" in launch.wanted:
            raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 1})
            launch.items["stopped"] = deployment.submit("stopped", raw, where, "--wait-nodes", "300")
        if "test_kill_9_of_flower_run_stops_its_run_on_the_superlink" in launch.wanted:
            raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 2, "rounds": 1})
            launch.items["killed"] = deployment.submit("killed", raw, where, "--wait-nodes", "300")
        if "test_flower_run_exits_2_when_the_server_app_refuses_its_input" in launch.wanted:
            taken = where / "flower-taken"  # output_dir holds something that is not a fedllm run
            taken.mkdir()
            (taken / "metrics.jsonl").write_text('{"round": 1}\n')
            launch.items["taken"] = deployment.submit("taken", tiny_recipe(), where, "--timeout", "60")
    return launch.items


@pytest.mark.slow
def test_flower_deployment_with_workers_matches_the_simulation(runs, deployment, tmp_path):  # noqa: F811
    sims = {}
    for name in CASES:  # the in-process simulations run while the deployment works
        sims[name] = run(parse_recipe({**runs[name].raw, "output_dir": str(tmp_path / f"sim-{name}")})).run_dir
    for name in CASES:
        runs[name].finish()
    link = deployment.procs[0].pid  # its runner collects each finished ServerApp child at once
    wait_until(lambda: not zombies(link), 240, "finished ServerApp children collected")  # a guard: at once
    for name, sim_dir in sims.items():
        flower_dir = runs[name].out
        # every fedllm process of the deployment applies the thread policy (here: the tests' OMP_NUM_THREADS=1, as
        # in this process): FedAvg and FRLoRA equal the simulation bit for bit
        assert_matches(sim_dir, flower_dir, ["adapter", "base"] if name == "frlora" else ["adapter"], name,
                       exact=name in ("fedavg", "frlora"))
        policy = json.loads((flower_dir / "summary.json").read_text())["threads"]
        assert (policy["source"], policy["threads"], policy["torch_threads"]) == ("OMP_NUM_THREADS", 1, 1), policy
        assert not (flower_dir / "final" / "clients.safetensors").exists()  # per-client state stays on the nodes
    want_base = load_file(str(sims["frlora"] / "final" / "base.safetensors"))
    for state in deployment.states.values():  # both nodes, participating or not, end with the server's base W^T
        step = sorted(state.glob("*/client-*/step-*"))
        node_base = {}
        for s in step:
            if (s / "base.safetensors").is_file():
                node_base = load_base(s)  # the snapshot with the log of merges since it replayed
        assert node_base.keys() == want_base.keys()
        assert max(float((want_base[k] - node_base[k]).abs().max()) for k in want_base) <= 1e-6
    for cid, log in deployment.logs.items():  # each worker built each run's federation once, whatever the messages
        assert "fedllm worker: CPU threads 1 (OMP_NUM_THREADS)" in log.read_text(errors="replace")
        text = log.read_text(errors="replace")[runs["offsets"].get(cid, 0):]
        lines = [line for line in text.splitlines() if "fedllm worker: built the federation of run" in line]
        built = [line.split(" of run ")[1].split()[0] for line in lines]
        # once per run: this module's four runs and those of its other runs that reached the nodes' discovery query
        # ("few", "stopped", "killed": the query announces a run: built then, not at the node's first train message;
        # FRLoRA samples one client a round, so the other node's first message comes a round later)
        assert len(CASES) <= len(built) <= len(CASES) + 3 and len(set(built)) == len(built), built
        assert all("(ahead of its first message)" in line for line in lines), lines  # a later run adds ", the base copied from memory"


@pytest.mark.slow
def test_status_page_of_a_deployment_run_in_headless_chromium(runs, deployment, tmp_path):  # noqa: F811
    """`fedllm flower status RUN_DIR --serve` on a real deployment's run: headless Chromium renders the round and the
    SuperNodes the ServerApp recorded (both nodes connected and serving), read from the page's DOM."""
    import status_page_kit as kit

    if kit.CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it)")
    run_dir = runs["fedavg"].out
    wait_until(lambda: (run_dir / "recipe.yaml").exists() or runs["fedavg"].proc.poll() is not None, 600,
               "the run directory", runs["fedavg"].log)
    with kit.status_page(run_dir, tmp_path / "page.log") as url:
        runs["fedavg"].finish()
        page = kit.rendered(url)
    assert (page["round"], page["rounds"], page["nodes"], page["serving"], page["state"]) == \
        ("2", "2", "2", "2 of 2", "finished"), page
    history = page["dom"].split('id="history">', 1)[1].split("</tbody>", 1)[0]
    assert history.count("<tr>") == 2  # one row per round


@pytest.mark.slow
def test_flower_run_with_too_few_supernodes_reports_and_exits_2(runs):
    """3 clients, 2 SuperNodes (busy with the other runs): after --wait-nodes ``fedllm flower run`` exits 2 naming
    the one client no node serves (the waiting reports: tests/test_flower_apps.py, on a fake clock)."""
    rc = runs["few"].wait(900)
    out = runs["few"].log.read_text()
    assert rc == 2, out[-3000:]
    assert "2 SuperNode(s) connected, 2 of 3 clients served (missing: [2])" in out
    assert "one SuperNode per client" in out


@pytest.mark.slow
def test_stopping_flower_run_stops_the_run_on_the_superlink(runs, deployment):  # noqa: F811
    stopped = runs["stopped"]
    wait_until(lambda: logged(stopped.log, "waiting"), 240, "the server waiting for nodes", stopped.log)
    run_id = stopped.run_id()
    stopped.proc.send_signal(signal.SIGTERM)
    stopped.wait(300)
    assert finished_status(deployment.env, run_id, 300, stopped.log)["status"] == "finished:stopped"


@pytest.mark.slow
def test_kill_9_of_flower_run_stops_its_run_on_the_superlink(runs, deployment):  # noqa: F811
    """``kill -9`` of ``fedllm flower run`` (the command alone): its guard child, told by Linux that its parent died,
    stops the run on the SuperLink (before: the run went on with no word of it) and removes the command's private
    FLWR_HOME."""
    killed = runs["killed"]
    wait_until(lambda: logged(killed.log, "waiting"), 240, "the server waiting for nodes", killed.log)
    run_id = killed.run_id()
    streams = [p for p in children(killed.proc.pid) if " log " in cmdline(p)]
    assert streams, "no flwr log child"
    environ = Path(f"/proc/{streams[0]}/environ").read_bytes().decode().split("\0")
    home = next(v.split("=", 1)[1] for v in environ if v.startswith("FLWR_HOME="))
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.wait(60)
    assert finished_status(deployment.env, run_id, 300, killed.log)["status"] == "finished:stopped"
    wait_until(lambda: not os.path.exists(home), 120, f"the private FLWR_HOME {home} removed")


def test_flower_run_exits_2_when_the_server_app_refuses_its_input(runs):
    """A ServerApp that raises on bad input (here: output_dir exists, is not empty and is not a fedllm run) gives
    exit code 2, as ``fedllm train`` does, and nothing in that directory is touched."""
    taken = runs["taken"]
    rc = taken.wait(300)
    out = taken.log.read_text()
    assert rc == 2, out[-3000:]
    assert "finished:failed" in out and "fedllm: error: output_dir=" in out and "is not a fedllm run" in out
    assert "ServerApp raised" not in out  # bad input is told as the CLI tells it, without fedllm's traceback
    assert (taken.out / "metrics.jsonl").read_text() == '{"round": 1}\n'


def test_kill_9_of_flower_supernode_leaves_no_process_behind_and_it_restarts_on_its_port(deployment, tmp_path):  # noqa: F811
    """``kill -9`` of ``fedllm flower supernode``: its SuperNode and worker die with it, and the same command starts
    again at once on the same ``--port``, whose connections from the worker wait in TIME-WAIT for about 60 s (before:
    ``--port=N: already in use``, exit 2)."""
    port = str(free_port())
    argv = ["flower", "supernode", "--superlink", deployment.address, "--client", "7", "--insecure", "--state-dir",
            str(tmp_path / "state"), "--port", port]
    node = start(argv, tmp_path / "node.log", deployment.env)
    again = None
    try:
        def running(proc, log):
            wait_until(lambda: worker_pid(proc) is not None and any("fedllm.flower.supernode" in c for c in map(
                cmdline, children(proc.pid))), 120, "SuperNode and worker", log)

        running(node, tmp_path / "node.log")
        wait_until(lambda: any(f":{int(port):04X} " in line and line.split()[3] in ("01", "06") for line in Path(
            "/proc/net/tcp").read_text().splitlines()[1:]), 120, "the worker connected to its SuperNode's port")
        family = children(node.pid)
        os.kill(node.pid, signal.SIGKILL)  # the command alone, not its process group
        node.wait()
        wait_until(lambda: not [p for p in family if os.path.exists(f"/proc/{p}")], 240,
                   f"every child of fedllm flower supernode gone ({family})")
        again = start(argv, tmp_path / "again.log", deployment.env)
        running(again, tmp_path / "again.log")
        assert again.poll() is None and "already in use" not in (tmp_path / "again.log").read_text()
    finally:
        stop(node)
        if again is not None:
            stop(again)


def test_kill_of_flower_superlink_frees_its_ports_for_a_restart_and_nodes_rejoin(tmp_path, tiny_recipe):
    """``kill PID`` (SIGTERM to the command alone) of ``fedllm flower superlink`` stops Flower's SuperLink and
    fedllm's ServerApp runner with it: no process survives, and a new one starts on the same port (before, the orphans
    kept the port and the restart failed with "address already in use"). Three SuperLinks one after the other:

    - restarted on its ``--database``: the run the first one was running (waiting for a second node) lost its
      ServerApp; the new SuperLink stops it as it starts (before, it was listed running with nothing behind it, and a
      node pulling its message waited minutes), and the node, whose session the database keeps, carries on;
    - restarted without a database: the node's session is unknown there; Flower's SuperNode exits and ``fedllm flower
      supernode`` starts it again until it joins the new SuperLink."""
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_HOME": str(tmp_path / "flwr")}
    write_flwr_home(tmp_path / "flwr", f"127.0.0.1:{port}")
    recipe = tmp_path / "two.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe(federation={"num_clients": 2, "clients_per_round": 2, "rounds": 1})))
    database = ["--database", str(tmp_path / "link.db")]
    node = submitted = run_id = None
    try:
        for attempt, options in (("first", database), ("restart", database), ("fresh", [])):
            link = start(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                          "--runs-dir", str(tmp_path), *options], tmp_path / f"{attempt}.log", env)
            log = tmp_path / f"{attempt}.log"
            try:
                wait_until(lambda: port_open(port) and any("fedllm.flower.runtime serverapps" in cmdline(p)
                                                          for p in children(link.pid)), 120,  # noqa: B023
                           f"{attempt} SuperLink and its ServerApp runner", log)
                if attempt == "first":
                    node = start(["flower", "supernode", "--superlink", f"127.0.0.1:{port}", "--client", "0",
                                  "--insecure", "--state-dir", str(tmp_path / "state")], tmp_path / "node.log", env)
                    wait_until(lambda: logged(tmp_path / "node.log", "SuperNode ID: "), 240, "the SuperNode joined",
                               tmp_path / "node.log")
                    submitted = start(["flower", "run", str(recipe), "--superlink", f"127.0.0.1:{port}", "--insecure",
                                       "--wait-nodes", "600"], tmp_path / "run.log", env)
                    wait_until(lambda: logged(tmp_path / "run.log", "waiting"), 240, "the run waiting for its 2nd "
                               "node", tmp_path / "run.log")
                    run_id = Run(submitted, tmp_path / "run.log", tmp_path, {}).run_id()
                elif attempt == "restart":
                    wait_until(lambda: logged(log, f"stopped run {run_id}: its ServerApp died"), 240,  # noqa: B023
                               "the orphaned run stopped", log)
                    assert run_status(env, run_id)["status"] == "finished:stopped"
                    wait_until(lambda: logged(tmp_path / "node.log", "Connection successful after"), 240,
                               "the node reconnected to the restarted SuperLink (Flower's retry)", tmp_path / "node.log")
                    assert (tmp_path / "node.log").read_text().count("SuperNode ID: ") == 1  # its session kept
                else:
                    wait_until(lambda: (tmp_path / "node.log").read_text().count("SuperNode ID: ") >= 2, 240,
                               "the SuperNode joined the fresh SuperLink", tmp_path / "node.log")
                    assert "node left the federation: Flower's SuperNode ended with code" in \
                        (tmp_path / "node.log").read_text()
                    assert not logged(log, "stopped run")  # no database: nothing of the earlier runs
                    break
                family = children(link.pid)
                os.kill(link.pid, signal.SIGTERM)  # the command alone, not its process group
                link.wait(timeout=300)  # a guard (as every wait here): seconds when idle
                wait_until(lambda: not [p for p in family if os.path.exists(f"/proc/{p}")], 240,  # noqa: B023
                           f"every child of fedllm flower superlink gone ({family})")
                assert not port_open(port)
            finally:
                stop(link)
    finally:
        for proc in (node, submitted):
            if proc is not None:
                stop(proc)
