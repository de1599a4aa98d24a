"""Flower's SuperLink as ``fedllm flower superlink`` runs it: only the Fleet API faces the network.

Open-source Flower 1.42 serves its three HTTP APIs on one port: the Fleet API (SuperNodes), the Control API
(``flwr run``/``ls``/``log``/``stop``, ``flwr supernode register``/``unregister``) and the Runtime API (the
ServerApp's task traffic). Its only Control API authentication is OIDC, which the open-source distribution lacks
("OIDC account authentication is unavailable in this Flower distribution"): anyone who completes the TLS
handshake — everyone holding the public ``ca.crt`` that every node has — may submit, stop and read any run and
register or unregister any node. ``python -m fedllm.flower.superlink ARGS`` runs ``flower-superlink ARGS`` with

- :class:`OperatorOnly` in front of Flower's own middleware (its extension hook): a request to anything but the
  Fleet API and the health check from a peer that is not this machine (127.0.0.0/8, ::1) gets 403 before Flower
  reads it. The SuperLink's operator reaches the Control API on this machine (or through an SSH tunnel to it);
  nodes reach the Fleet API from anywhere. uvicorn trusts ``X-Forwarded-For`` from 127.0.0.1 only, so a
  reverse proxy on this machine must pass the client's address in it (a plain TCP forwarder would make every
  peer look local: do not put one in front);
- the process umask 077: the SuperLink database (``--database FILE`` with its ``-wal`` and ``-shm``, holding node
  keys, run configs, logs and live task tokens) and every other file it creates are readable by its owner only,
  from their creation;
- a running task (the ServerApp's) kept through 3 minutes without a heartbeat, not 60 s
  (:mod:`fedllm.flower.task_patience`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fedllm.flower.task_patience import tolerate_stalls

PUBLIC_PATHS = ("/v1/fleet/", "/health")
"""Path prefixes any peer may reach: the Fleet API (SuperNodes) and the health check."""

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def is_local(client: tuple[str, int] | list | None) -> bool:
    """True when the peer ``client`` (ASGI ``scope["client"]``: host, port) is this machine."""
    if not client:
        return False
    try:
        address = ipaddress.ip_address(str(client[0]).split("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def allowed(path: str, client: tuple[str, int] | list | None) -> bool:
    """Whether a request for ``path`` from ``client`` may reach Flower."""
    return path.startswith(PUBLIC_PATHS) or is_local(client)


class OperatorOnly:
    """ASGI middleware: the Control and Runtime APIs answer only peers on this machine (403 for others)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not allowed(scope.get("path", ""), scope.get("client")):
            body = json.dumps({"detail": "fedllm: the Control and Runtime APIs of this SuperLink answer only its own "
                                         "machine (127.0.0.1); use flwr on the SuperLink's machine or through an "
                                         "SSH tunnel to it"}).encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def install_guard() -> None:
    """Put :class:`OperatorOnly` first in the middleware Flower's SuperLink app is built with."""
    from flwr.superlink import extensions
    from starlette.middleware import Middleware

    flower_own = extensions.get_middleware
    extensions.get_middleware = lambda: (Middleware(OperatorOnly), *flower_own())


def main(argv: list[str] | None = None) -> None:
    """``flower-superlink`` with :class:`OperatorOnly` and umask 077 (``argv``: its arguments)."""
    os.umask(0o077)
    for internal in ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API"):  # gRPC servers: unguarded
        os.environ.pop(internal, None)
    install_guard()
    tolerate_stalls()
    from flwr.superlink.cli import flower_superlink

    sys.argv = ["flower-superlink", *(sys.argv[1:] if argv is None else argv)]
    sys.exit(flower_superlink())


if __name__ == "__main__":
    main()
