"""Ctrl-C stops a test run within seconds and leaves no process behind (hooks that tests/conftest.py takes in).

Without them, one Ctrl-C on README's ``python -m pytest -q -n 2`` left the run going for 10 s or more and processes
behind. pytest-xdist's controller, interrupted, asks each worker to exit and waits up to 10 s
(``NodeManager.EXIT_TIMEOUT``) before killing it; a worker interrupted in a test runs that test's teardown first (a
Flower deployment's: several processes, each with its grace period), and a second Ctrl-C lands in that wait. And the
processes tests start in sessions of their own (Flower's SuperLink and SuperNodes, torchrun, ``fedllm flower``) get
no SIGINT from the terminal at all: a test interrupted before its teardown left them running.

So the process that runs the session (pytest itself, or pytest-xdist's controller) marks its environment with a
run id (``FEDLLM_TEST_RUN``), which every process below it inherits — the workers, and the processes tests start in
sessions of their own — and when the session is interrupted it ends every process that carries its mark: a SIGTERM
to each, then after a short grace a SIGKILL to what is left (the workers among them). Found with ``tests/cli/test_interrupt.py``. (A first version made the session the kernel's *subreaper* of
everything below it; then every orphan a test left — a killed SuperLink's children — stayed a zombie of the session
until it ended, and the tests that wait for such processes to be gone never saw them go.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

MARK = "FEDLLM_TEST_RUN"
"""The environment variable that marks every process of one test run (set by the session, inherited below it)."""
GRACE_S = 2.0
"""How long the processes of an interrupted run get to end on SIGTERM before they are killed."""


def pytest_configure(config) -> None:
    if not hasattr(config, "workerinput"):  # the session's process (a run of its own, even inside another's test)
        os.environ[MARK] = f"{os.getpid()}-{time.time_ns()}"  # its workers and every process below inherit it


def pytest_keyboard_interrupt(excinfo) -> None:
    if os.environ.get(MARK, "").startswith(f"{os.getpid()}-"):  # the session's process (a worker leaves it to it)
        stop_marked()


def marked(run: str) -> list[int]:
    """The running processes, but this one, whose environment carries ``MARK=run`` (zombies left out)."""
    needle = f"{MARK}={run}".encode()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] == "Z":
                        continue
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # it ended meanwhile, or is not ours to read
                continue
    return found


def _reap() -> None:
    """Collect this process's ended children."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def stop_marked(grace_s: float = GRACE_S) -> None:
    """SIGTERM every process of this run (its mark); SIGKILL those still there after ``grace_s``."""
    run = os.environ.get(MARK)
    if not run:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in marked(run):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while marked(run) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
        _reap()
