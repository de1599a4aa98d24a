"""A SuperNode restarted after a crash rejoins at once: ``fedllm flower supernode`` ends its own dead session.

Killed without signing off (``kill -9`` of all its processes, a crash, a power cut), a SuperNode's session stays online
in the SuperLink until two of its heartbeats are missed (Flower: 2 x 30 s), and Flower refuses to activate its key
meanwhile: restarted at once, the node waited up to 75 s before it could serve again (the 60 s, then the next retry
of :mod:`fedllm.flower.rejoin`).

So each time its SuperNode joins, the command records in the state directory which process holds the session
(:func:`record`: its pid and start time, the machine and its boot) and the node id. Restarted, it reads that record
before it starts Flower's SuperNode: when the SuperLink counts the key online (:func:`fedllm.flower.reach.key_status`)
and that process is gone (its pid free or reused, or the machine rebooted since), the session is dead, and the node
ends it itself with the Fleet API's ``DeactivateNode`` signed with its node key (the SuperLink takes that request for
a node only signed with the node's own key), then activates at once. When the recorded process still runs (the same
node started twice) or the record is another machine's, nothing is ended: Flower refuses the activation and the node
retries as before. A node without a node key (``--insecure``, ``--insecure-nodes``) registers a new key at each
start and is never refused this way.
"""

from __future__ import annotations

import json
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


def boot_id() -> str:
    """This boot of this machine (Linux; empty elsewhere)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def started_at(pid: int) -> str:
    """Process ``pid``'s start time (clock ticks since boot, /proc), empty when no live process has that pid (a zombie
    counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return "" if fields[0] in ("Z", "X") else fields[19]


@dataclass
class Session:
    """Which process held a node's session in the SuperLink, and the node id it had there."""

    node_id: int
    pid: int
    started: str
    boot: str
    host: str

    def is_dead(self) -> bool:
        """True when the process that held the session is certainly gone: the same machine, and rebooted since or
        no process with that pid and start time. False when it may run (or runs on another machine)."""
        if self.host != socket.gethostname() or not self.boot:
            return False
        return self.boot != boot_id() or not self.started or started_at(self.pid) != self.started


def record(marker: Path, node_id: int, pid: int, started: str | None = None) -> None:
    """Write into ``marker`` (the state directory's ``.node-K.activated``) that process ``pid``, started at
    ``started`` (:func:`started_at`, read now when None), holds the session of node ``node_id``."""
    session = Session(node_id, pid, started_at(pid) if started is None else started, boot_id(), socket.gethostname())
    marker.write_text(json.dumps(asdict(session)))


def recorded(marker: Path) -> Session | None:
    """The session written by :func:`record`; None when there is none (a marker written by an older fedllm: empty)."""
    try:
        return Session(**json.loads(marker.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def deactivate(address: str, root_certificates: str | None, auth_key: Path, node_id: int) -> str:
    """End node ``node_id``'s session in the SuperLink at ``address`` with Flower's ``DeactivateNode``, signed with
    ``auth_key`` (the node's private key). Returns "" when done, else why not."""
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key
    from flwr.proto.fleet_pb2 import DeactivateNodeRequest  # pylint: disable=no-name-in-module
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    key = load_ssh_private_key(auth_key.expanduser().read_bytes(), password=None)
    try:
        with FleetHttpClient.from_server_address(address, root_certificates is None, root_certificates,
                                                 [NodeAuthHttpInterceptor(key, key.public_key())]) as client:
            client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
    except Exception as e:  # noqa: BLE001 — any failure leaves the refusal standing: the node retries as before
        return f"{type(e).__name__}: {str(e)[:200]}"
    return ""


def end_if_dead(marker: Path, address: str, root_certificates: str | None, auth_key: str | None) -> str:
    """End the session recorded in ``marker`` when the SuperLink counts it online and its process is gone (module
    docstring). Returns what was done, for the node's log; "" when nothing was ended (no node key, no record, a
    process that may still hold it, a session not online, or a SuperLink that refused: said)."""
    from fedllm.flower.node_keys import public_bytes
    from fedllm.flower.reach import PREVIOUS_SESSION, key_status

    session = recorded(marker)
    if not auth_key or session is None or not session.is_dead():
        return ""
    if key_status(address, root_certificates, public_bytes(Path(auth_key).expanduser())) != "online":
        return ""  # signed off, timed out, or a SuperLink that cannot tell (not fedllm's): Flower's activation decides
    failed = deactivate(address, root_certificates, Path(auth_key), session.node_id)
    if failed:
        print(f"fedllm flower supernode: could not end the dead previous session of node {session.node_id}: {failed}",
              file=sys.stderr, flush=True)
        return ""
    return (f"{PREVIOUS_SESSION}, and the process that held it (pid {session.pid}) is gone: ended that session "
            f"(node {session.node_id}) with the node's key")
