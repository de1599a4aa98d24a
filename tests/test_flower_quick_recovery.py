"""How fast a Flower deployment recovers from a kill, in the parts fedllm controls (no Flower deployment here):

- the node worker is forked again from a parent holding its imports when it dies (fedllm.flower.worker_restart);
- fedllm's SuperNode asks an unreachable SuperLink again within 2 s, not Flower's 20 s (fedllm.flower.supernode);
- fedllm's SuperLink stops within 3 s of SIGTERM although a log stream is open (fedllm.flower.superlink).
"""

import inspect
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

from flower_cluster import free_port, state

from fedllm.flower import superlink, supernode


def wait_for(check, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc is None or proc.poll() is None, f"{what}: the process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.1)


def test_a_killed_worker_is_forked_again_with_its_imports_and_stops_with_its_parent(tmp_path):
    """``serve_forked`` after the worker's imports: the forked worker runs torch on two threads; killed with
    ``kill -9``, the next one is forked at once, with the imports (nothing imported again) and a new pid; SIGTERM to the
    parent stops the worker, then the parent (exit code 128 + 15)."""
    pids = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, sys, time
        from fedllm.flower import worker_restart
        from fedllm.flower.runtime import WORKER_IMPORTS, import_ahead

        def serve():
            fresh = [name for name in WORKER_IMPORTS if name not in sys.modules]  # imported by the parent, not here
            import torch
            torch.set_num_threads(2)
            a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
            ok = torch.allclose((a @ a.T).diagonal(), (a * a).sum(1), atol=1e-3)
            with open({str(pids)!r}, "a") as f:
                f.write(f"{{os.getpid()}} {{ok}} {{fresh}}\\n")
            if len(open({str(pids)!r}).read().splitlines()) == 1:
                os.kill(os.getpid(), signal.SIGKILL)  # the first worker dies as a kill -9 would end it
            time.sleep(600)

        sys.exit(worker_restart.serve_forked(serve, import_ahead))
        """)], env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        def lines() -> list[list[str]]:
            return [line.split(" ", 2) for line in pids.read_text().splitlines()] if pids.is_file() else []

        wait_for(lambda: len(lines()) == 2, 240, "a second worker", parent)
        (first, ok1, fresh1), (second, ok2, fresh2) = lines()
        assert first != second and (ok1, fresh1, ok2, fresh2) == ("True", "[]", "True", "[]")
        assert state(int(first)) is None  # collected by the parent, not left <defunct>
        os.kill(parent.pid, signal.SIGTERM)
        assert parent.wait(30) == 128 + signal.SIGTERM
        assert state(int(second)) is None
        assert "node worker exited with code -9; restarting it" in parent.stderr.read()
    finally:
        if parent.poll() is None:
            os.killpg(parent.pid, signal.SIGKILL)
            parent.wait()


def test_supernode_reconnects_within_2_s_and_keeps_the_rest_of_flowers_retry():
    """The invoker fedllm's SuperNode builds for its Fleet API calls waits 0.25, 0.5, 1, 2, 2 s at most (Flower: 1, 2,
    4, 8, 16, 20 s, ``MAX_RETRY_DELAY``), jittered as Flower jitters; what it retries and when it gives up are
    Flower's."""
    from flwr.common.constant import MAX_RETRY_DELAY
    from flwr.supernode import fleet_http_connection

    assert MAX_RETRY_DELAY == 20  # the constant the docstring names
    assert "make_simple_http_retry_invoker()" in inspect.getsource(fleet_http_connection.http_request_response)
    module = type("FleetHttpConnection", (), {"make_simple_http_retry_invoker":
                                              staticmethod(fleet_http_connection.make_simple_http_retry_invoker)})
    flowers = module.make_simple_http_retry_invoker()
    supernode.quick_reconnects(module)
    ours = module.make_simple_http_retry_invoker()
    waits = ours.wait_gen_factory()
    assert [next(waits) for _ in range(6)] == [0.25, 0.5, 1.0, 2.0, 2.0, 2.0]
    theirs = flowers.wait_gen_factory()
    assert [next(theirs) for _ in range(7)] == [1, 2, 4, 8, 16, 20, 20]
    for same in ("recoverable_exceptions", "max_tries", "max_time", "jitter"):
        assert getattr(ours, same) == getattr(flowers, same), same


STREAMING_APP = '''
import asyncio, sys
from fedllm.flower.superlink import PromptShutdown

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            else:
                print("lifespan shutdown ran", flush=True)
                await send({"type": "lifespan.shutdown.complete"})
                return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    while True:  # a log stream: never ends by itself
        await send({"type": "http.response.body", "body": b"line\\n", "more_body": True})
        await asyncio.sleep(0.2)

PromptShutdown.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def test_superlink_stops_within_its_grace_while_a_log_stream_is_open():
    """uvicorn as fedllm's SuperLink runs it (:class:`PromptShutdown`), serving a response that never ends (as
    ``flwr log``'s stream): SIGTERM stops it within ``GRACEFUL_SHUTDOWN_S`` plus its shutdown, well before the 10 s
    after which ``fedllm flower superlink`` kills it, and its lifespan shutdown runs (a kill would skip it)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", STREAMING_APP, str(port)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        def streaming() -> socket.socket | None:
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                return None
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            return sock

        conn: list = []
        wait_for(lambda: conn.append(streaming()) or conn[-1] is not None, 120, "the server listening", server)
        assert b"line" in conn[-1].recv(4096) or b"line" in conn[-1].recv(4096)  # the stream flows
        started = time.monotonic()
        os.kill(server.pid, signal.SIGTERM)
        assert server.wait(30) == -signal.SIGTERM  # uvicorn raises the signal it caught again once it has shut down
        took = time.monotonic() - started
        assert superlink.GRACEFUL_SHUTDOWN_S <= took < superlink.GRACEFUL_SHUTDOWN_S + 4, took
        assert "lifespan shutdown ran" in server.stdout.read()
        conn[-1].close()
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


LEAVES_THEN_STOPS = """
import sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
print("SuperNode ID: 7", flush=True)
sys.exit(0 if n == 1 else 130)  # the SuperLink restarted without its database (401: Flower's SuperNode ends); Ctrl-C
"""


def test_the_node_worker_outlives_a_restart_of_flowers_supernode(tmp_path, monkeypatch):
    """Flower's SuperNode ends by itself (a restarted SuperLink did not know its session) and ``serve_node`` starts it
    again: the node worker started with the first one keeps running (its imports, its warm runs), is not started a
    second time, and is stopped when the command ends."""
    from fedllm.flower import processes, rejoin

    slept, sleep = [], rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: slept.append(s) if s >= 1 else sleep(s))
    workers = []

    def worker():
        workers.append(processes.start([sys.executable, "-S", "-c", "import time; time.sleep(600)"]))
        return workers[-1]

    count = tmp_path / "starts"
    cmd = [sys.executable, "-S", "-c", LEAVES_THEN_STOPS, str(count)]
    assert rejoin.serve_node(cmd, {"node worker": worker}, tmp_path / "state", 2) == 130
    assert count.read_text() == "2" and slept == [2.0]  # Flower's SuperNode started twice, the rejoin waited once
    assert len(workers) == 1 and workers[0].poll() == -signal.SIGTERM  # one worker, stopped at the end
