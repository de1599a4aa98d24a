"""The real Flower deployment of the deployment tests (tests/test_flower_deployment.py and
tests/test_flower_security.py), on 127.0.0.1: ``fedllm flower superlink`` and ``fedllm flower supernode`` as
subprocesses on free ports, readiness by polling, everything stopped at the end.

One deployment serves both modules (:func:`deployment`): a TLS SuperLink with SuperNode authentication and
the SuperNodes of clients 0 and 1 with their workers. Each module submits all of its runs at once, at its first
test (:class:`Launch`), and every test then waits on its own run: the runs wait on Flower's polling and timers
side by side instead of one after another.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORKER_HOOKS = Path(__file__).resolve().parent / "worker_hooks"
"""tests/worker_hooks/sitecustomize.py: the SuperNodes' test-only stop point (inert until a test arms it)."""


def env_for(home: Path) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "FLWR_HOME": str(home), "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def hooked(env: dict, stop_at: Path) -> dict:
    """``env`` with :data:`WORKER_HOOKS` first on ``PYTHONPATH`` and its stop folder ``stop_at``."""
    path = os.pathsep.join(p for p in (str(WORKER_HOOKS), env.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "FEDLLM_TESTS_STOP_AT": str(stop_at)}


def start(args, log_path, env, cwd=None):
    """A fedllm command in its own process group (its Flower children die with it), in ``cwd`` if given."""
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "fedllm", *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd=cwd)


def stop(proc, sig=signal.SIGTERM):
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def stop_all(procs, sig=signal.SIGTERM, grace_s=20.0):
    """:func:`stop` every process of ``procs`` at once (each SuperNode takes seconds to sign off: side by side, not
    one after another), each signalled once: a second SIGTERM reaches ``fedllm flower supernode`` while it stops its
    worker, with Python's default handler back, and ends it at once; its SuperNode then did not sign off (seen at load
    10-18: the session of its key stayed online for 60 s, refusing the next node of that key, a later module's)."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop(proc, signal.SIGKILL)


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


def state(pid: int) -> str | None:
    """The state letter of process ``pid`` in /proc (``Z``: exited, waiting to be collected), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def zombies(pid: int) -> list[int]:
    """The descendants of ``pid`` that have exited and wait to be collected (``<defunct>``)."""
    return [kid for kid in children(pid) if state(kid) == "Z"]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def parent(pid: int) -> int | None:
    """The parent pid of process ``pid`` (None once it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def worker_pid(supernode: subprocess.Popen) -> int | None:
    """The pid of the fedllm node worker serving ``fedllm flower supernode``'s SuperNode (None: none running): the
    process forked by the worker's parent, which holds the imports (fedllm.flower.worker_restart)."""
    found = [p for p in children(supernode.pid) if "fedllm.flower.runtime clientapps" in cmdline(p)]
    serving = [p for p in found if parent(p) in found]
    return serving[0] if serving else None


def run_status(flwr_env: dict, run_id: str) -> dict:
    """``flwr ls --run-id`` of the run on the SuperLink named ``fedllm`` in ``flwr_env``'s FLWR_HOME."""
    out = subprocess.run([str(Path(sys.executable).parent / "flwr"), "ls", "--run-id", run_id, "fedllm", "--format",
                          "json"], capture_output=True, text=True, env=flwr_env)
    text = out.stdout
    try:
        return (json.loads(text[text.index("{"):]).get("runs") or [{}])[0]
    except ValueError:
        return {}


def finished_status(flwr_env: dict, run_id: str, timeout_s: float, log_path=None) -> dict:
    """The :func:`run_status` of the run once it has finished (each look is a ``flwr`` process, ~1.3 CPU-s: one a
    second)."""
    last: dict = {}

    def finished() -> bool:
        nonlocal last
        last = run_status(flwr_env, run_id)
        return str(last.get("status", "")).startswith("finished")

    wait_until(finished, timeout_s, f"run {run_id} to finish", log_path, every_s=1.0)
    return last


def write_flwr_home(home: Path, address: str, ca: Path | None = None) -> None:
    home.mkdir(parents=True, exist_ok=True)
    conn = f'address = "{address}"\n' + (f'root-certificates = "{ca}"\n' if ca else "insecure = true\n")
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fedllm"\n\n[superlink.fedllm]\n{conn}')


@dataclass
class Run:
    """A ``fedllm flower run`` submitted in the background: its process, log and output directory."""

    proc: subprocess.Popen
    log: Path
    out: Path
    raw: dict

    def wait(self, timeout_s: float) -> int:
        """The exit code, within ``timeout_s`` (else the test fails with the log's tail)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"no result within {timeout_s:.0f}s; log:\n{self.log.read_text()[-3000:]}")

    def finish(self, timeout_s: float = 900) -> None:
        """Wait for the run and require exit code 0."""
        rc = self.wait(timeout_s)
        assert rc == 0, self.log.read_text()[-3000:]

    def run_id(self) -> str:
        """The SuperLink's id of this run (once ``fedllm flower run`` has printed it)."""
        wait_until(lambda: logged(self.log, "fedllm flower run: run "), 240, "the run's id", self.log)
        return self.log.read_text().split("fedllm flower run: run ", 1)[1].split()[0]


class Deployment:
    """A TLS SuperLink with SuperNode authentication (``fedllm flower superlink --certificates``; the keys of
    clients 0..3 registered) and the SuperNodes of clients 0 and 1, each with its fedllm node worker."""

    CLIENT_KEYS = 4

    def __init__(self, root: Path):
        from fedllm.flower.certs import write_certificates

        self.root = root
        self.certs = root / "certs"
        write_certificates(self.certs, ["127.0.0.1"], clients=self.CLIENT_KEYS)
        self.env = env_for(root / "flwr-home")
        port = free_port()
        self.address = f"127.0.0.1:{port}"
        write_flwr_home(root / "flwr-home", self.address, self.certs / "ca.crt")
        self.runs_dir = root.parent  # the session's temporary directory: every test's runs write inside it
        self.procs = [start(["flower", "superlink", "--certificates", str(self.certs), "--host", "127.0.0.1",
                             "--port", str(port), "--runs-dir", str(self.runs_dir)], root / "superlink.log", self.env)]
        self.nodes: dict[int, subprocess.Popen] = {}
        self.logs: dict[int, Path] = {}  # client -> log of the SuperNode serving it now
        self.states = {cid: root / f"node{cid}" for cid in range(2)}
        self.stops = root / "stops"  # Deployment.stop_at's files
        self.stops.mkdir()
        try:
            for cid in range(2):  # side by side with the SuperLink's start: each waits until it takes nodes
                self.serve(cid)
            last = f"client-{self.CLIENT_KEYS - 1}.pub registered"
            wait_until(lambda: port_open(port) and logged(root / "superlink.log", last), 180,
                       "SuperLink with node keys registered", root / "superlink.log")
        except BaseException:
            self.close()
            raise

    def key(self, cid: int) -> Path:
        return self.certs / "nodes" / f"client-{cid}.key"

    def node(self, cid: int, name: str, state: Path, *options: str, key: Path | None = None,
             ca: Path | None = None, logs: Path | None = None) -> subprocess.Popen:
        """``fedllm flower supernode --client cid`` (key: client ``cid``'s unless given), logging to ``name``.log."""
        proc = start(["flower", "supernode", "--superlink", self.address, "--client", str(cid), "--root-certificates",
                      str(ca or self.certs / "ca.crt"), "--auth-key", str(key or self.key(cid)), "--state-dir",
                      str(state), "--port", str(free_port()), *options], (logs or self.root) / f"{name}.log",
                     hooked(self.env, self.stops))
        self.procs.append(proc)
        return proc

    def stop_at(self, cid: int, rnd: int) -> Path:
        """Arm the stop point of tests/worker_hooks/sitecustomize.py: the process of a SuperNode serving client
        ``cid`` that opens the round ``rnd`` train message (received and journaled, not yet answered) stops itself
        with SIGSTOP and writes its pid into the returned file, whose appearance is the event to wait on."""
        armed = self.stops / f"stop-client-{cid}-round-{rnd}"
        armed.touch()
        return armed.with_name(armed.name + ".reached")

    def serve(self, cid: int, name: str | None = None) -> None:
        """(Re)start the SuperNode of client ``cid`` (0 or 1) on its state directory."""
        name = name or f"node{cid}"
        self.nodes[cid] = self.node(cid, name, self.states[cid], "--warm-runs", "8")  # every run of the modules
        self.logs[cid] = self.root / f"{name}.log"

    def submit(self, name: str, raw: dict, where: Path, *options: str, out: Path | None = None) -> Run:
        """``fedllm flower run`` of ``raw`` (output in ``out``, default ``where/flower-NAME``; log
        ``where/run-NAME.log``)."""
        out = out or where / f"flower-{name}"
        path = where / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**raw, "output_dir": str(out)}))
        log = where / f"run-{name}.log"
        proc = start(["flower", "run", str(path), "--superlink", self.address, "--root-certificates",
                      str(self.certs / "ca.crt"), "--timeout", "600", *options], log, self.env)
        self.procs.append(proc)
        return Run(proc, log, out, raw)

    def close(self) -> None:
        stop_all(self.procs[:0:-1])  # the SuperNodes and runs, then the SuperLink they sign off from
        stop(self.procs[0])


def assert_matches(sim_dir: Path, flower_dir: Path, parts: list[str], what: str, exact: bool = False) -> None:
    """The final ``parts`` (adapter, base) of a Flower run equal the simulation's (<= 1e-6; bit for bit with
    ``exact``), and so do the losses."""
    from safetensors.torch import load_file

    for part in parts:
        want = load_file(str(sim_dir / "final" / f"{part}.safetensors"))
        got = load_file(str(flower_dir / "final" / f"{part}.safetensors"))
        assert want.keys() == got.keys()
        worst = max(float((want[k] - got[k]).abs().max()) for k in want)
        assert worst <= (0.0 if exact else 1e-6), f"{what} {part}: max abs difference {worst}"
    sim_lines = [json.loads(x) for x in (sim_dir / "metrics.jsonl").read_text().splitlines()]
    got_lines = [json.loads(x) for x in (flower_dir / "metrics.jsonl").read_text().splitlines()]
    want = [x.get("train_loss") for x in sim_lines]  # none under SecAgg+ / DP (privacy.per_client_stats)
    assert [x.get("train_loss") for x in got_lines] == (want if None in want else pytest.approx(want, abs=1e-6))


_SHARED: dict[str, Deployment] = {}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, request):
    """The session's one :class:`Deployment`: started by the first module that asks, stopped after the last
    selected test that uses it (or when pytest exits)."""
    if "it" not in _SHARED:
        _SHARED["it"] = Deployment(tmp_path_factory.mktemp("flower"))
        request.config.add_cleanup(_SHARED["it"].close)
    yield _SHARED["it"]
    items = request.session.items
    mine = [i for i, item in enumerate(items) if item.module is request.module]
    if not any("deployment" in item.fixturenames for item in items[max(mine, default=-1) + 1:]):
        _SHARED.pop("it").close()


class Launch:
    """A module's background work, started together by its first test (only what its selected tests need)."""

    def __init__(self):
        self.started = False
        self.items: dict = {}
        self.procs: list[subprocess.Popen] = []

    def begin(self, request) -> bool:
        """True the first time (the caller then starts the module's work); which tests are selected: ``wanted``."""
        if self.started:
            return False
        self.started = True
        self.wanted = {item.originalname for item in request.session.items if item.module is request.module}
        return True

    def close(self) -> None:
        stop_all([item.proc if isinstance(item, Run) else item for item in self.items.values()
                  if isinstance(item, (Run, subprocess.Popen))] + self.procs)


@pytest.fixture(scope="module")
def launch():
    """The module's :class:`Launch` (what it started is stopped when the module ends)."""
    launched = Launch()
    yield launched
    launched.close()
