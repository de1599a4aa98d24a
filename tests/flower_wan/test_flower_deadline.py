"""federation.round_deadline on a real Flower deployment: one SuperNode behind a WAN proxy turned slow (125 B/s) as
soon as it has its round-1 train message; the round stops waiting at the deadline, drops the late client, and the
run (FedAvg with per-client optimizer moments, 2 rounds) equals the simulation in which that client failed in round 1:
its node starts round 2 from the state the server knows (none), not from the late round's moments."""

import json

import pytest
import yaml

from fedllm.engine import server
from fedllm.flower.wan_proxy import DOWN, UP, Link, WanProxy, running
from fedllm.recipe.checks import parse_recipe
from tests.flower_cluster import assert_matches, env_for, free_port, port_open, start, stop, wait_until

SLOW = Link(mbit_s=0.001, burst_bytes=64)  # 125 B/s: a reply of ~10 kB takes minutes; back to fast within 0.5 s


def _rounds(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_the_deadline_drops_a_slow_node_and_the_run_equals_the_simulation_without_it(tiny_recipe, tmp_path,
                                                                                    monkeypatch):
    env = env_for(tmp_path / "flwr-home")
    port = free_port()
    procs = [start(["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), "--runs-dir",
                    str(tmp_path)], tmp_path / "superlink.log", env)]
    raw = tiny_recipe(federation={"num_clients": 3, "clients_per_round": 3, "rounds": 2, "round_deadline": "10x"},
                      train={"optimizer_state": "per_client"})
    raw["output_dir"] = str(tmp_path / "flower-run")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(raw))
    try:
        wait_until(lambda: port_open(port), 120, "SuperLink listening", tmp_path / "superlink.log")
        with running(WanProxy(("127.0.0.1", port))) as proxy:
            for cid in range(3):
                address = f"127.0.0.1:{proxy.address[1] if cid == 2 else port}"
                procs.append(start(["flower", "supernode", "--superlink", address, "--client", str(cid), "--insecure",
                                    "--state-dir", str(tmp_path / "state"), "--port", str(free_port())],
                                   tmp_path / f"supernode{cid}.log", env))
            run = start(["flower", "run", str(recipe), "--superlink", f"127.0.0.1:{port}", "--insecure", "--timeout",
                         "600"], tmp_path / "run.log", env)
            procs.append(run)
            node_log = tmp_path / "supernode2.log"
            wait_until(lambda: "Receiving: train message" in node_log.read_text(errors="replace"), 600,
                       "node 2's round-1 train message", node_log, every_s=0.02)
            proxy.links = {UP: SLOW, DOWN: SLOW}  # its reply now crawls
            run_dir = tmp_path / "flower-run"
            wait_until(lambda: len(_rounds(run_dir)) >= 1, 600, "round 1 aggregated", tmp_path / "run.log")
            proxy.links = {UP: Link(), DOWN: Link()}  # back to loopback for round 2
            assert run.wait(timeout=600) == 0, (tmp_path / "run.log").read_text()[-3000:]
    finally:
        for p in reversed(procs):
            stop(p)

    first, second = _rounds(run_dir)
    assert first["late"] == {"2": None} and first["dropped"]["2"].startswith("late: no upload by the round's deadline")
    assert set(first["client_loss"]) == {"0", "1"} and set(second["client_loss"]) == {"0", "1", "2"}
    assert second["late"] == {}
    assert json.loads((run_dir / "summary.json").read_text())["late"] == {"1": [2]}

    # the simulation of the same recipe in which client 2 fails in round 1 (a non-finite upload)
    original = server.run_client

    def fail_client_2_in_round_1(model, plan, *args, **kwargs):
        update = original(model, plan, *args, **kwargs)
        if (plan.rnd, plan.client_id) == (1, 2):
            next(iter(update.state.values())).view(-1)[0] = float("nan")
        return update

    monkeypatch.setattr(server, "run_client", fail_client_2_in_round_1)
    sim = {**raw, "output_dir": str(tmp_path / "sim")}
    sim["federation"] = {k: v for k, v in raw["federation"].items() if k != "round_deadline"}
    sim_dir = server.run(parse_recipe(sim)).run_dir
    assert_matches(sim_dir, run_dir, ["adapter"], "round deadline", exact=True)
