"""A SuperNode receiving a message while its SuperLink is restarted: how long until it drops it (issue 49, item 8).

One loopback deployment (``fedllm flower superlink --insecure``, one ``fedllm flower supernode``, ``fedllm flower
run`` of a tiny 1-client recipe). The first SuperLink acknowledges the ServerApp's object uploads from the run's first
message on without storing them (a test-only patch, loaded through ``sitecustomize`` in that SuperLink's processes
only), so the node sits in Flower's ``pull_objects`` on a message whose objects stay "not available yet", as a node
does when the SuperLink dies in the middle of the upload. The SuperLink is then stopped (SIGTERM to the command) and
started again, on its database (``--database yes``: the message and its missing objects are kept there) or without
one (``--database no``). Prints, in seconds after the stop: the old SuperLink gone, the new one listening, and what
the node's log said when (``reconnected``: Flower's retry reached the new SuperLink; ``dropped``: Flower's "not in
`RUNNING` status. Ignoring message" or "Failed to receive message"; ``left``: Flower's SuperNode ended and ``fedllm
flower supernode`` restarts it; ``rejoined``: the new SuperLink activated it).

    python bench/flower_restart_pull.py --database no
    python bench/flower_restart_pull.py --database yes

``--kill-serverapp`` instead kills (SIGKILL) the run's ServerApp process, the child of fedllm's ServerApp runner, and
leaves the SuperLink up; it prints when the node dropped the message and when ``flwr ls`` first listed the run as
finished (``finished``), in seconds after the kill:

    python bench/flower_restart_pull.py --database no --kill-serverapp
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CUT_UPLOADS = '''
import os
if os.environ.get("FEDLLM_BENCH_CUT_UPLOADS"):
    from flwr.proto.message_pb2 import PushObjectResponse
    from flwr.superlink.servicer.runtime import runtime_handlers as rh
    real_push_messages, real_push_object, cut = rh.push_messages, rh.push_object, []
    def push_messages(request, state, task):
        cut.append(True)
        return real_push_messages(request, state, task)
    def push_object(request, state, task):
        return PushObjectResponse(stored=True) if cut else real_push_object(request, state, task)
    rh.push_messages, rh.push_object = push_messages, push_object
'''
"""``sitecustomize.py`` of the first SuperLink: its Runtime API acknowledges every object upload after the run's
first message without storing it (Flower 1.42's handler module, looked up at each call)."""
EVENTS = {"reconnected": "Connection successful after", "dropped": ("is not in `RUNNING` status. Ignoring message",
                                                                     "Failed to receive message"),
          "left": "node left the federation", "rejoined": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True
    except OSError:
        return False


def wait_for(check, timeout_s: float, what: str, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"flower_restart_pull: {what}: not within {timeout_s:.0f} s")
        time.sleep(every_s)


def fedllm(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedllm", *args], stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--database", choices=("yes", "no"), required=True, help="restart the SuperLink on its database")
    p.add_argument("--wait", type=float, default=400, help="seconds to wait for the node after the restart")
    p.add_argument("--kill-serverapp", action="store_true", help="kill -9 the ServerApp, keep the SuperLink up")
    args = p.parse_args()

    import yaml

    from fedllm.data.synthetic import generate_arith

    work = Path(tempfile.mkdtemp(prefix="flower-restart-pull-"))
    site = work / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(CUT_UPLOADS)
    data = work / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_arith(16)))
    recipe = {"seed": 0, "output_dir": str(work / "run"), "model": {"name": "tiny-llama"}, "lora": {"r": 4, "alpha": 8},
              "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question",
                                                                               "output": "answer"}},
              "federation": {"num_clients": 1, "clients_per_round": 1, "rounds": 1},
              "train": {"local_steps": 1, "batch_size": 4, "max_length": 64, "dtype": "fp32"},
              "logging": {"progress": False, "quiet": True}}
    (work / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    port = free_port()
    home = work / "flwr"
    home.mkdir()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fedllm"\n\n[superlink.fedllm]\naddress = '
                                      f'"127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    cut_env = {**env, "FEDLLM_BENCH_CUT_UPLOADS": "1",
               "PYTHONPATH": os.pathsep.join(x for x in (str(site), env.get("PYTHONPATH", "")) if x)}
    database = ["--database", str(work / "link.db")] if args.database == "yes" else []
    link_args = ["flower", "superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), *database]
    node_log = work / "node.log"
    procs: list[subprocess.Popen] = []
    try:
        link = fedllm([*link_args, "--runs-dir", str(work)], work / "link1.log", cut_env)
        procs.append(link)
        wait_for(lambda: listening(port), 180, "the first SuperLink")
        procs.append(fedllm(["flower", "supernode", "--superlink", f"127.0.0.1:{port}", "--client", "0", "--insecure",
                             "--state-dir", str(work / "state")], node_log, env))
        wait_for(lambda: "SuperNode ID: " in node_log.read_text(errors="replace"), 300, "the node joined")
        run = fedllm(["flower", "run", str(work / "recipe.yaml"), "--superlink", f"127.0.0.1:{port}", "--insecure",
                      "--wait-nodes", "600"], work / "run.log", env)
        procs.append(run)
        wait_for(lambda: "Receiving: " in node_log.read_text(errors="replace") or run.poll() is not None, 300,
                 "the node receiving a message")
        if run.poll() is not None:
            raise SystemExit(f"flower_restart_pull: the run ended first: {(work / 'run.log').read_text()[-2000:]}")
        time.sleep(2)  # the node pulls objects that stay "not available yet"
        seen_before = node_log.read_text(errors="replace")
        if args.kill_serverapp:
            return kill_serverapp(link, node_log, seen_before, env, args.wait, work)
        family = subprocess.run(["pgrep", "-g", str(link.pid)], capture_output=True, text=True, check=False).stdout.split()
        stopped = time.monotonic()
        os.kill(link.pid, signal.SIGTERM)
        link.wait(timeout=300)
        wait_for(lambda: not [p for p in family if os.path.exists(f"/proc/{p}")], 300, "the first SuperLink gone")
        gone = time.monotonic() - stopped
        procs.append(fedllm([*link_args, "--runs-dir", str(work)], work / "link2.log", env))
        wait_for(lambda: listening(port), 180, "the second SuperLink")
        up = time.monotonic() - stopped
        at: dict[str, float] = {}

        def watch() -> bool:
            text = node_log.read_text(errors="replace")[len(seen_before):]
            for name, marks in EVENTS.items():
                hit = ("SuperNode ID: " in text) if marks is None else any(
                    m in text for m in ((marks,) if isinstance(marks, str) else marks))
                if hit and name not in at:
                    at[name] = time.monotonic() - stopped
            return "rejoined" in at or (args.database == "yes" and "dropped" in at)

        wait_for(watch, args.wait, "the node dropping the message or rejoining")
        events = ", ".join(f"{name} {t:.1f}" for name, t in sorted(at.items(), key=lambda kv: kv[1]))
        print(f"database {args.database}: old SuperLink gone {gone:.1f}, new one listening {up:.1f}; node: {events} "
              f"(s after the stop; {os.getloadavg()[0]:.1f} load); logs in {work}")
    finally:
        for proc in reversed(procs):
            stop(proc)


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(x) for x in out.split()]


def kill_serverapp(link: subprocess.Popen, node_log: Path, seen_before: str, env: dict, wait_s: float,
                   work: Path) -> None:
    """SIGKILL the ServerApp (the runner's child), keep the SuperLink up; when the node drops the message and when the
    run is listed finished."""
    runner = [p for p in children(link.pid)
              if "serverapps" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
    apps = [c for r in runner for c in children(r)]
    if len(apps) != 1:
        raise SystemExit(f"flower_restart_pull: expected one ServerApp process under the runner {runner}, found {apps}")
    killed = time.monotonic()
    os.kill(apps[0], signal.SIGKILL)
    at: dict[str, float] = {}

    def watch() -> bool:
        text = node_log.read_text(errors="replace")[len(seen_before):]
        if "dropped" not in at and any(m in text for m in EVENTS["dropped"]):
            at["dropped"] = time.monotonic() - killed
        if "finished" not in at:
            flwr = str(Path(sys.executable).parent / "flwr")
            listed = subprocess.run([flwr, "ls", "fedllm", "--format", "json"], capture_output=True, text=True, env=env,
                                    check=False).stdout
            runs = json.loads(listed[listed.find("{"):] or "{}").get("runs") or []
            if runs and all(str(r.get("status", "")).startswith("finished") for r in runs):
                at["finished"] = time.monotonic() - killed
                at["status: " + ", ".join(str(r.get("status")) for r in runs)] = at["finished"]
        return "dropped" in at and "finished" in at

    wait_for(watch, wait_s, "the node dropping the message and the run finished", every_s=0.5)
    events = ", ".join(f"{name} {t:.1f}" for name, t in sorted(at.items(), key=lambda kv: kv[1]))
    print(f"ServerApp killed: {events} (s after the kill; {os.getloadavg()[0]:.1f} load); logs in {work}")


if __name__ == "__main__":
    main()
