"""The Flower tutorial's "M machines" section (docs/tutorials/flower-federation.md, README's before it moved), run top
to bottom from its own text on one machine.

The commands are read from that page (nothing here restates them): the certificate step, the SuperLink, one
SuperNode per client, the run; and the section's one-process run of the same recipe, whose final model the Flower
run must equal bit for bit, in the environment a user has (no thread count set: each process picks its own, and
the nodes train with the run's). The SuperNodes are started first, the SuperLink only once every node said it is
waiting for it, as typed at human speed on a slow machine. Only the page's placeholders are filled in:
``SERVER`` is 127.0.0.1, README's port 9092 becomes a free port (``--port`` added to the SuperLink's command),
``K`` is each client, ``/var/lib/fedllm`` a directory per client, the optional ``[--data my.jsonl]`` and the
``--resume`` line (tested in tests/test_flower_deployment.py) are left out. They run in a scratch directory that
holds the recipe and its data at their README paths, as "run them from the repository root" would.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from flower_cluster import assert_matches, env_for, free_port, logged, start, stop_all, wait_until

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[1]


def flower_section() -> str:
    text = (ROOT / "docs" / "tutorials" / "flower-federation.md").read_text()
    return text[text.index("**M machines**"):text.index("`fedllm flower run` is `flwr run")]


def readme_commands() -> dict[str, list[list[str]]]:
    """The section's ``fedllm`` commands by step (``certs``, ``superlink``, ``supernode``, ``run``) as argv lists,
    with the one-process ``train`` of the section's opening block; trailing ``# ...`` comments dropped."""
    text = (ROOT / "docs" / "tutorials" / "flower-federation.md").read_text()
    opening = text[text.index("**One process** (laptop"):text.index("**N processes / GPUs**")]
    lines = re.findall(r"^fedllm train .*$", opening, re.MULTILINE)
    section = flower_section()
    lines += re.findall(r"`(fedllm flower certs [^`]+)`", section)
    lines += re.findall(r"^(fedllm flower (?:superlink|supernode|run) .*)$", section, re.MULTILINE)
    steps: dict[str, list[list[str]]] = {}
    for line in lines:
        argv = shlex.split(line.split("  #")[0].replace("[--data my.jsonl]", ""))
        if "--resume" in argv:
            continue
        steps.setdefault(argv[1] if argv[1] != "flower" else argv[2], []).append(argv[1:])
    return steps


def filled(argv: list[str], port: int, client: str = "") -> list[str]:
    """README's placeholders filled in (see the module docstring)."""
    out = []
    for arg in argv:
        arg = arg.replace("SERVER:9092", f"127.0.0.1:{port}").replace("127.0.0.1:9092", f"127.0.0.1:{port}")
        arg = "127.0.0.1" if arg == "SERVER" else arg
        if client:
            arg = arg.replace("client-K", f"client-{client}").replace("/var/lib/fedllm", f"state-{client}")
            arg = client if arg == "K" else arg
        out.append(arg)
    return out


def test_flower_readme_commands_are_found():
    """The parse itself (so that a README edit that moves a step fails here, not as a hang below)."""
    steps = readme_commands()
    assert [len(steps.get(k, [])) for k in ("train", "certs", "superlink", "supernode", "run")] == [1, 1, 1, 1, 1]
    assert "K" in steps["supernode"][0] and "SERVER" in steps["certs"][0]


def test_flower_readme_section_runs_as_written_and_equals_one_process(tmp_path):
    steps = readme_commands()
    recipe = steps["run"][0][2]  # flower run RECIPE ...
    for rel in (recipe, "tests/assets/data/arith/train.jsonl"):  # README's paths, relative to where it runs
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    env = {**env_for(tmp_path / "flwr-home"), "PYTHONPATH": str(ROOT)}
    for chosen in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "FEDLLM_THREADS"):  # a user's environment: none set
        env.pop(chosen, None)

    def run_step(argv: list[str]) -> None:
        done = subprocess.run([sys.executable, "-m", "fedllm", *argv], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=1800, check=False)  # a guard: ~1 min idle
        assert done.returncode == 0, f"{shlex.join(argv)}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"

    port = free_port()
    run_step(filled(steps["certs"][0], port))
    clients = [p.stem.split("-", 1)[1] for p in sorted((tmp_path / "certs" / "nodes").glob("client-*.key"))]
    assert clients == ["0", "1", "2", "3"]  # README's --clients 4, the recipe's num_clients
    # the section's one-process run, side by side with the deployment (which mostly waits on its polls and timers);
    # its result depends on the recipe alone
    train = filled(steps["train"][0], port)
    one_process_run = start(train, tmp_path / "train.log", env, tmp_path)
    procs = []
    try:
        try:
            for cid in clients:  # the nodes first: each waits for the SuperLink, saying so
                procs.append(start(filled(steps["supernode"][0], port, cid), tmp_path / f"node{cid}.log", env,
                                   tmp_path))
            for cid in clients:
                wait_until(lambda c=cid: logged(tmp_path / f"node{c}.log", "waiting for the SuperLink at "), 300,
                           f"SuperNode {cid} waiting for the SuperLink", tmp_path / f"node{cid}.log")
            link_log = tmp_path / "superlink.log"
            procs.append(start(filled(steps["superlink"][0], port) + ["--port", str(port)], link_log, env, tmp_path))
            wait_until(lambda: logged(link_log, "ready: SuperNodes may join"), 300, "the SuperLink, with the node "
                       "keys registered", link_log)
            run_step(filled(steps["run"][0], port))  # at once, as a user would: it waits --wait-nodes for the nodes
            for cid in clients:
                text = (tmp_path / f"node{cid}.log").read_text()
                assert "Failed to activate SuperNode" not in text and "takes nodes now" in text, text[-2000:]
        finally:  # the SuperNodes together (each takes seconds to sign off), then the SuperLink they sign off from
            stop_all(procs[:len(clients)])
            stop_all(procs[len(clients):])
        done = one_process_run.wait(timeout=1800)  # a guard: ~1 min idle
        assert done == 0, f"{shlex.join(train)}\n{(tmp_path / 'train.log').read_text()[-3000:]}"
    finally:
        stop_all([one_process_run])  # only if the test failed before it ended
    flower_dir = tmp_path / next(a.split("=", 1)[1] for a in steps["run"][0] if a.startswith("output_dir="))
    assert (tmp_path / "superlink.db").exists()  # README's --database, kept across a SuperLink restart
    one_process = tmp_path / yaml.safe_load((tmp_path / recipe).read_text())["output_dir"]
    # FRLoRA's merges: into an fp32 base (base.safetensors), or beside a bf16 one (base-residual.safetensors: the
    # recipe's train.dtype is auto, bf16 on a CPU that computes it)
    bases = [p for p in ("base", "base-residual") if (one_process / "final" / f"{p}.safetensors").exists()]
    assert bases
    assert_matches(one_process, flower_dir, ["adapter", *bases], "README's FRLoRA recipe", exact=True)
