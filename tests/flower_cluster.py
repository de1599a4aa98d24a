"""A real Flower deployment on 127.0.0.1 for the deployment tests: ``fedllm flower superlink`` and
``fedllm flower supernode`` as subprocesses on free ports, readiness by polling, everything stopped at the end."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(home: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def start(args, log_path, env):
    """A fedllm command in its own process group (its Flower children die with it)."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "fedllm", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)


def stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_until(check, timeout_s, what, log_path=None, every_s=0.3):
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            tail = Path(log_path).read_text()[-3000:] if log_path else ""
            raise AssertionError(f"{what}: not within {timeout_s}s\n{tail}")
        time.sleep(every_s)


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def logged(path, text) -> bool:
    return Path(path).is_file() and text in Path(path).read_text(errors="replace")


def children(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kids.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for kid in kids.get(todo.pop(), []):
            out.append(kid)
            todo.append(kid)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def worker_pid(supernode: subprocess.Popen) -> int | None:
    """The pid of the fedllm node worker that ``fedllm flower supernode`` started (None: none running)."""
    found = [p for p in children(supernode.pid) if "fedllm.flower.runtime clientapps" in cmdline(p)]
    return found[0] if found else None


def run_status(flwr_env: dict, run_id: str) -> dict:
    """``flwr ls --run-id`` of the run on the SuperLink named ``fedllm`` in ``flwr_env``'s FLWR_HOME."""
    out = subprocess.run([str(Path(sys.executable).parent / "flwr"), "ls", "--run-id", run_id, "fedllm", "--format",
                          "json"], capture_output=True, text=True, env=flwr_env)
    text = out.stdout
    try:
        return (json.loads(text[text.index("{"):]).get("runs") or [{}])[0]
    except ValueError:
        return {}


def write_flwr_home(home: Path, address: str, ca: Path | None = None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    conn = f'address = "{address}"\n' + (f'root-certificates = "{ca}"\n' if ca else "insecure = true\n")
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fedllm"\n\n[superlink.fedllm]\n{conn}')
