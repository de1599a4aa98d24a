"""The node worker restarted after a crash in milliseconds: forked from a parent that already holds its imports.

``python -m fedllm.flower.runtime clientapps`` (the node worker ``fedllm flower supernode`` starts) runs as two
processes. The parent imports what answering a message needs (:data:`fedllm.flower.runtime.WORKER_IMPORTS`: torch,
transformers, peft and fedllm's engine, about 12 CPU-seconds on a 2-core EPYC), runs no torch operation and starts
no thread, and forks the worker that serves (:func:`serve_forked`). When that worker dies (``kill -9``, the
out-of-memory killer, a crash) the parent forks the next one, which answers the journaled message first
(:func:`fedllm.flower.runtime.replay_journal`). Before, ``fedllm flower supernode`` started a new Python that paid
those imports again before it could answer: 32 s from the kill to the answer in a trial at load 6-8 on 2 cores.

The parent shares its memory with the worker (copy on write) and sleeps in ``waitpid``; SIGTERM, SIGINT and SIGHUP
stop the worker, then the parent. Killed itself, the parent takes the worker with it (the worker's parent-death
signal, :class:`fedllm.flower.processes.Forked`).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from fedllm.flower import processes


def restart_note(code: int) -> str:
    """What the node's log says when the worker ended with ``code`` (negative: the signal)."""
    return f"fedllm: node worker exited with code {code}; restarting it (forked: its imports kept)"


def serve_forked(serve: Callable[[], object], prepare: Callable[[], object], restart_s: float = processes.RESTART_S,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], object] = time.sleep) -> int:
    """Run ``prepare()`` (the imports) once, then ``serve()`` in a forked child, again each time the child ends, at
    most once every ``restart_s`` (a worker that cannot start does not spin). Returns ``128 + signal`` once a
    forwarded signal (:data:`fedllm.flower.processes.FORWARDED`) has stopped the child."""
    prepare()
    child: processes.Forked | None = None

    def stop(sig: int, _frame) -> None:
        raise processes.Stopped(sig)

    previous = {sig: signal.signal(sig, stop) for sig in processes.FORWARDED}
    try:
        while True:
            started = clock()
            child = processes.Forked(lambda: serve() or 0)
            code = child.wait()
            print(restart_note(code), file=sys.stderr, flush=True)
            sleep(max(0.0, restart_s - (clock() - started)))
    except processes.Stopped as stopped:
        return 128 + stopped.sig
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if child is not None:
            processes.stop(child)


def can_fork() -> bool:
    """Whether this platform forks (Linux, macOS); elsewhere the worker is one process, as before."""
    return hasattr(os, "fork")
