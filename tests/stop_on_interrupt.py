"""Ctrl-C stops a test run within seconds and leaves no process behind (hooks that tests/conftest.py takes in).

Without them, one Ctrl-C on README's ``python -m pytest -q -n 2`` left the run going for 10 s or more and processes
behind. pytest-xdist's controller, interrupted, asks each worker to exit and waits up to 10 s
(``NodeManager.EXIT_TIMEOUT``) before killing it; a worker interrupted in a test runs that test's teardown first (a
Flower deployment's: several processes, each with its grace period), and a second Ctrl-C lands in that wait. And the
processes tests start in sessions of their own (Flower's SuperLink and SuperNodes, torchrun, ``fedllm flower``) get
no SIGINT from the terminal at all: a test interrupted before its teardown left them running.

So the process that runs the session (pytest itself, or pytest-xdist's controller) makes itself the *subreaper* of
everything below it (Linux ``PR_SET_CHILD_SUBREAPER``: a process whose parent dies is re-parented to it rather than
to init, so that nothing escapes the tree), and when the session is interrupted it ends every process below it: a
SIGTERM to each, then after a short grace a SIGKILL to what is left. The same runs in each worker (its own tests'
processes go at once). Found with ``tests/cli/test_interrupt.py``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 2.0
"""How long the processes of an interrupted run get to end on SIGTERM before they are killed."""


def pytest_configure(config) -> None:
    if hasattr(config, "workerinput") or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not Linux's libc: orphans go to init, as before
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def pytest_keyboard_interrupt(excinfo) -> None:
    stop_descendants()


def _processes() -> dict[int, tuple[int, str]]:
    """``pid -> (parent pid, state)`` of every process (``/proc``); {} where there is no ``/proc``."""
    found = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:  # it ended meanwhile
                continue
            found[int(entry)] = (int(fields[1]), fields[0])
    return found


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` that have not ended (zombies left out), parents before their children."""
    procs = _processes()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in procs.items():
        children.setdefault(parent, []).append(child)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            todo.append(child)
            if procs[child][1] != "Z":
                out.append(child)
    return out


def _reap() -> None:
    """Collect this process's ended children (the orphans re-parented to it among them)."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def stop_descendants(grace_s: float = GRACE_S) -> None:
    """SIGTERM every process below this one; SIGKILL those still there after ``grace_s``."""
    me = os.getpid()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in descendants(me):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while descendants(me) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)
        _reap()
