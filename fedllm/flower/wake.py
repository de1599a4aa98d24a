"""The SuperNode wakes its node worker when a message arrives, instead of the worker asking every 0.25 s.

The worker (:func:`fedllm.flower.runtime.serve_clientapps`) claims its node's tasks over the SuperNode's local Runtime
API; a claim is an HTTP request to the SuperNode, so a worker that asks four times a second while idle costs both
processes CPU for nothing. fedllm's SuperNode (:mod:`fedllm.flower.supernode`) sends one datagram to the worker's
socket right after it has stored a message (and so created its task), and the idle worker waits on that socket: it
claims at once when woken, and otherwise only every :data:`FALLBACK_S` (a wake lost because the worker was
restarting).

The socket lives in Linux's abstract namespace under a name derived from the worker's secret
(``--superexec-auth-secret-file``, which both processes read), so no file is created and nothing else can guess
the name; a datagram carries no data, only "claim now", and a claim still needs the secret. Where abstract sockets
do not exist the worker falls back to polling every ``--poll`` seconds.
"""

from __future__ import annotations

import hashlib
import logging
import select
import socket
import time
from pathlib import Path

FALLBACK_S = 2.0
"""Seconds between an idle worker's claims when it listens for wakes (a wake it missed costs at most this)."""


def address(secret: bytes) -> str:
    """The worker's wake socket: an abstract-namespace name derived from the worker's secret."""
    return "\0fedllm-worker-wake-" + hashlib.sha256(b"fedllm wake\0" + secret).hexdigest()[:32]


def listening_workers() -> int:
    """How many fedllm node workers listen on this machine: their wake sockets in ``/proc/net/unix`` (0 where it
    cannot be read)."""
    try:
        lines = Path("/proc/net/unix").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    return len({fields[-1] for fields in map(str.split, lines)
                if len(fields) > 7 and fields[-1].startswith("@fedllm-worker-wake-")})


def local_workers() -> int:
    """The node workers on this machine, this one included (at least 1)."""
    return max(1, listening_workers())


def notify(secret: bytes) -> None:
    """Tell the worker holding ``secret`` that a task is waiting (nothing happens when no worker listens)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.sendto(b"", address(secret))
    except OSError:  # no worker listening (starting, restarting, --no-worker), or no abstract sockets here
        pass


class Wakeup:
    """The worker's end: ``wait(seconds)`` sleeps until the SuperNode's next wake or ``seconds`` pass."""

    def __init__(self, secret: bytes):
        self.sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(address(secret))
            self.sock.setblocking(False)
        except OSError as e:  # e.g. no abstract namespace (not Linux): poll instead
            logging.getLogger("fedllm").info("fedllm worker: no wake socket (%s); claiming tasks by polling", e)
            self.sock.close()
            self.sock = None

    def wait(self, seconds: float) -> bool:
        """Sleep until a wake arrives (True) or ``seconds`` pass (False); wakes already queued are consumed."""
        if self.sock is None:
            time.sleep(seconds)
            return False
        ready, _, _ = select.select([self.sock], [], [], seconds)
        woken = False
        while ready:
            try:
                self.sock.recv(16)
                woken = True
            except BlockingIOError:
                break
        return woken

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
