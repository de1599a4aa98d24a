"""The node keys ``fedllm flower superlink`` registers with its SuperLink (``flwr supernode register``), once.

A SuperLink restarted on its ``--database FILE`` still holds the keys registered before: registering them again
makes Flower's SuperLink log ``ERROR Public key already in use`` for each. So the keys already in the database are
read from it first (read-only, before the SuperLink starts: Flower 1.42's ``node`` table, whose ``public_key`` is the
key as ``flwr supernode register`` sends it) and only the others are registered. A key unregistered meanwhile
(``flwr supernode unregister``) is registered again.
"""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path


def key_bytes(pub: Path) -> bytes:
    """``pub`` (OpenSSH public key) as ``flwr supernode register`` sends it to the SuperLink."""
    from cryptography.hazmat.primitives import serialization
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    return public_key_to_bytes(serialization.load_ssh_public_key(pub.read_bytes()))


def public_bytes(private_key: Path) -> bytes:
    """The public half of a node's private key (``nodes/client-K.key``) as :func:`key_bytes` gives it."""
    from cryptography.hazmat.primitives import serialization
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    key = serialization.load_ssh_private_key(private_key.read_bytes(), password=None)
    return public_key_to_bytes(key.public_key())


def registered(database: str) -> set[bytes]:
    """The public keys registered (and not unregistered) in the SuperLink database file ``database``; empty for an
    in-memory database, a file not created yet, or one this Flower's schema cannot be read from."""
    if database.startswith(":") or not Path(database).is_file():
        return set()
    try:
        with sqlite3.connect(f"{Path(database).resolve().as_uri()}?mode=ro", uri=True) as db:
            rows = db.execute("SELECT public_key FROM node WHERE public_key IS NOT NULL AND "
                              "(status IS NULL OR status != 'unregistered')").fetchall()
    except sqlite3.Error:
        return set()
    return {bytes(row[0]) for row in rows}


def register(nodes: Path, env: dict[str, str], flwr: str, known: set[bytes], say) -> None:
    """Register every ``client-K.pub`` of ``nodes`` whose key is not in ``known`` with the SuperLink named
    ``fedllm`` in ``env``'s FLWR_HOME, all at once (a ``flwr`` process each: about 1.3 CPU-seconds, mostly its
    imports); ``say(line)`` tells each key's outcome."""
    started = {}
    for pub in sorted(nodes.glob("client-*.pub")):
        if key_bytes(pub) in known:
            say(f"node key {pub.name} registered (kept in the SuperLink's database since an earlier start)")
        else:
            started[pub] = subprocess.Popen([flwr, "supernode", "register", str(pub), "fedllm"], env=env, text=True,
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    told = {pub: proc.communicate()[0] for pub, proc in started.items()}
    for pub, text in told.items():
        if started[pub].returncode == 0:
            say(f"node key {pub.name} registered")
        elif "already in use" in text.lower():  # in the database, though not read from it above
            say(f"node key {pub.name} registered before (the SuperLink's 'ERROR Public key already in use' is this "
                "check)")
        else:
            raise RuntimeError(f"registering {pub} with the SuperLink failed: {text[-1000:]}")
