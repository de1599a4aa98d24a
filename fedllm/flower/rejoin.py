"""A SuperNode that leaves the federation by itself comes back: ``fedllm flower supernode`` starts Flower's SuperNode
again, with backoff, when it ends without having been told to.

Two ways a node that had joined ends on its own: it was killed without signing off (``kill -9``, a crash) and,
restarted at once, the SuperLink still counts its old session online and refuses to activate its key until two
heartbeats (Flower: 2 x 30 s) have passed ("Failed to activate SuperNode", exit 1); or the SuperLink restarted and
answers its heartbeat with 401, and Flower's SuperNode exits "gracefully" (code 0). Either way :func:`serve_node`
starts it again after 2, 4, 8, then every 15 s, for up to :data:`REJOIN_S` in all. The node worker is not restarted
with it: it keeps its imports and warm runs and claims the new SuperNode's tasks (before, it was stopped and started
anew: about 12 CPU-seconds of imports again, beside the SuperNode's own).

Before each start the command waits until the SuperLink takes nodes (:mod:`fedllm.flower.reach`: fedllm's SuperLink
holds its Fleet API back until it has registered the node keys, a ``flwr supernode register`` each, seconds apart),
so a node started before the SuperLink, or while it registers the keys, waits instead of being refused. A node that
never joined (the marker file below never written) and whose activation was refused all the same (a SuperLink that
is not fedllm's) is retried the same way for up to :data:`REGISTER_S`, after which the refusal is final (a key the
SuperLink was not given); at once when fedllm's SuperLink, which took nodes only once its keys were registered, says
it does not know the key; for up to :data:`REJOIN_S` when it says a session of the key is online (one started from
another state directory, or stopped without signing off: it times out within 2 heartbeats). Each refusal is told with its cause, asked of the SuperLink (the key's status there).

A node killed without signing off and restarted does not wait out its old session when the process that held it is
gone: it ends that session itself and rejoins at once (:mod:`fedllm.flower.dead_session`; the marker file below
records which process holds the session).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedllm.flower import dead_session, processes
from fedllm.flower.reach import REFUSALS, refusal_cause

ACTIVATED = "SuperNode ID: "
"""What ``flower-supernode`` prints once the SuperLink has activated it."""
ACTIVATION_REFUSED = "Failed to activate SuperNode"
"""What it prints (then exits 1) when the SuperLink refuses to activate it: an unknown key, or the key's previous
session still counted online (a node killed without deactivating stays online for 2 heartbeats of 30 s)."""
REJOIN_S = 150.0
"""How long a node that was activated before retries a refused activation (the 60 s above, with a margin)."""
REGISTER_S = 30.0
"""How long a node that never joined retries a refused activation: its key may not be registered yet (a SuperLink
registered the four keys of README's example in 18 s at load 6 on 2 cores, a ``flwr`` process each). Kept short: a
key the SuperLink was never given is refused for good after it: its SuperNode gave up after 75 s with a 45 s window
at load 2-6, one SuperNode start per try, and tests/test_flower_security.py allows 120 s)."""


class ActivationWatch:
    """Start ``flower-supernode`` with its output copied through this process, noting whether it was activated
    and whether its activation was refused."""

    def __init__(self, marker: Path):
        self.marker = marker  # exists once this node's key was activated at least once (state directory)
        self.refused = self.activated = False
        self.reader: Any = None

    def start(self, cmd: list[str]) -> subprocess.Popen:
        import threading

        self.refused = self.activated = False
        proc = processes.start(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                               bufsize=1)
        # its start time now, while it surely runs: read when it says it joined, a node that stopped at once since
        # (kill -9, Ctrl-C) would leave no start time in the record
        started = dead_session.started_at(proc.pid)

        def copy() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                if ACTIVATED in line:
                    self.activated = True
                    node_id = line.split(ACTIVATED, 1)[1].strip()
                    if node_id.isdigit():  # which process holds the session: fedllm.flower.dead_session
                        dead_session.record(self.marker, int(node_id), proc.pid, started)
                    else:
                        self.marker.touch()
                self.refused = self.refused or ACTIVATION_REFUSED in line

        self.reader = threading.Thread(target=copy, daemon=True)
        self.reader.start()
        return proc

    def read_all(self, timeout_s: float = 5.0) -> None:
        """Wait until the last start's output is read to its end (its verdict lines included)."""
        if self.reader is not None:
            self.reader.join(timeout_s)


def rejoin_delays(total_s: float = REJOIN_S, first_s: float = 2.0, cap_s: float = 15.0):
    """The waits between activation attempts: doubling from ``first_s`` up to ``cap_s``, ``total_s`` in all."""
    waited, delay = 0.0, first_s
    while waited + delay <= total_s:
        yield delay
        waited += delay
        delay = min(2 * delay, cap_s)


def serve_node(cmd: list[str], helpers: dict[str, Callable[[], subprocess.Popen]], state: Path, client: int,
               superlink_ready: Callable[[], bool] = lambda: True,
               refused_why: Callable[[], str] = lambda: refusal_cause(""),
               end_dead_session: Callable[[Path], str] = lambda marker: "") -> int:
    """Supervise Flower's SuperNode ``cmd`` (and ``helpers``: the node worker) until this command is stopped, starting
    it again when it leaves the federation by itself after having joined (see the module). Each start waits for
    ``superlink_ready()`` (:func:`fedllm.flower.reach.wait_for_superlink`; False: exit 1); ``refused_why()`` says why
    the SuperLink refused to activate the node (:func:`fedllm.flower.reach.refusal_cause`); ``end_dead_session(marker)``
    ends the previous session recorded in ``marker`` when its process is gone and says so (else "":
    :func:`fedllm.flower.dead_session.end_if_dead`), asked before a start until it has ended one, and again after each
    outage. Returns the exit code."""
    state.mkdir(parents=True, exist_ok=True)
    workers: dict[str, subprocess.Popen] = {}  # the helpers outlive Flower's SuperNode: warm across its restarts
    try:
        return _serve(cmd, helpers, client, superlink_ready, refused_why, end_dead_session,
                      ActivationWatch(state / f".node-{client}.activated"), workers)
    finally:
        processes.stop_all(list(workers.values()))


def _serve(cmd: list[str], helpers: dict[str, Callable[[], subprocess.Popen]], client: int,
           superlink_ready: Callable[[], bool], refused_why: Callable[[], str], end_dead_session: Callable[[Path], str],
           watch: ActivationWatch, workers: dict[str, subprocess.Popen]) -> int:
    """:func:`serve_node`'s loop; the helpers' processes stay in ``workers`` from one start of the SuperNode to the
    next (the node worker keeps its imports and warm runs: it claims the restarted SuperNode's tasks)."""
    delays, first = rejoin_delays(), rejoin_delays(REGISTER_S)
    may_end = True  # the dead previous session may be ended (once per outage)
    while True:
        if not superlink_ready():
            return 1
        ended = end_dead_session(watch.marker) if may_end and watch.marker.exists() else ""
        if ended:  # not refused, and not waiting 2 x 30 s for the SuperLink to let it go
            may_end = False
            print(f"fedllm flower supernode: client {client}'s node: {ended}; joining now", file=sys.stderr, flush=True)
        rc = processes.supervise(lambda: watch.start(cmd), helpers, kept=workers)
        if rc >= 128:  # stopped by a signal to this command
            return rc
        watch.read_all()
        if not watch.marker.exists():  # never joined: refused before its key was registered, else final
            why = refused_why() if watch.refused else ""
            if not watch.refused or why == REFUSALS["unknown"]:
                delay = None  # fedllm's SuperLink took nodes once its keys were registered: an unknown key stays so
            elif why == REFUSALS["online"]:
                delay = next(delays, None)  # a session of this key (another state directory's, or not signed off)
            else:
                delay = next(first, None)
            if delay is None:
                if watch.refused:
                    print(f"fedllm flower supernode: the SuperLink refused to activate client {client}'s node: {why}; "
                          "giving up", file=sys.stderr, flush=True)
                return rc
            print(f"fedllm flower supernode: the SuperLink refused to activate client {client}'s node: {why}; "
                  f"retrying in {delay:.0f} s (for up to {REJOIN_S if why == REFUSALS['online'] else REGISTER_S:.0f} s)",
                  file=sys.stderr, flush=True)
            time.sleep(delay)
            continue
        # Flower's SuperNode ended by itself: refused activation (exit 1), or told by the SuperLink that its session
        # is unknown (a restarted SuperLink answers its heartbeat with 401, and it exits "gracefully", code 0)
        if watch.activated:  # it was serving: a new outage (a SuperLink restart), with a new allowance
            delays, may_end = rejoin_delays(), True
        why = (refused_why() if watch.refused else
               f"Flower's SuperNode ended with code {rc} (the SuperLink restarted, or is unreachable)")
        delay = next(delays, None)
        if delay is None:
            print(f"fedllm flower supernode: client {client}'s node could not rejoin the SuperLink within "
                  f"{REJOIN_S:.0f} s; giving up", file=sys.stderr, flush=True)
            return rc
        print(f"fedllm flower supernode: client {client}'s node left the federation: {why}; rejoining in "
              f"{delay:.0f} s (retrying for up to {REJOIN_S:.0f} s)", file=sys.stderr, flush=True)
        time.sleep(delay)


