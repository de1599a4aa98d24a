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
  (:mod:`fedllm.flower.task_patience`);
- a stop that does not wait on open connections (:func:`prompt_shutdown`): on SIGTERM Flower's uvicorn server waited
  for every connection to close, and ``fedllm flower run``'s ``flwr log`` stream never closes by itself, so
  ``fedllm flower superlink`` killed it after its 10 s grace (:data:`fedllm.flower.processes.GRACE_S`), before its
  shutdown ran; now the requests still open after :data:`GRACEFUL_SHUTDOWN_S` are cancelled and it shuts down;
- a request's body handed to Flower's middleware in one message (:mod:`fedllm.flower.whole_body`): its eight
  layers worked per piece of the body the socket delivered, hundreds per 5 MiB object over a slow link;
- :class:`OperatorOnly` also holds the Fleet API back (503, which Flower's SuperNode retries) until ``fedllm flower
  superlink`` has registered the node keys (``--fedllm-ready-file FILE``: it writes FILE then), and answers
  ``GET`` :data:`READY_PATH` for any peer (200 once ready, 503 with what it waits for before): a SuperNode started
  before the SuperLink, or while it registers the keys, waits instead of being refused ("Failed to activate
  SuperNode") for a key the SuperLink is about to know.
"""

from __future__ import annotations

import importlib
import ipaddress
import json
import os
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fedllm.flower.task_patience import tolerate_stalls

PUBLIC_PATHS = ("/v1/fleet/", "/health")
"""Path prefixes any peer may reach: the Fleet API (SuperNodes) and the health check."""
READY_PATH = "/fedllm/ready"
"""Any peer may ask it whether the SuperLink takes SuperNodes yet (:func:`is_ready`)."""
WAITING = "registering the node keys (fedllm flower superlink)"
"""What a SuperLink that is not ready yet waits for."""
READY_FILE: str | None = None
"""Written by ``fedllm flower superlink`` once the node keys are registered; None: ready from the start."""
_seen_ready = False
GRACEFUL_SHUTDOWN_S = 3.0
"""How long a stopping SuperLink lets open requests finish (a node's upload in flight) before it cancels them (a log
stream) and shuts down (uvicorn: no limit)."""


def is_ready() -> bool:
    """True once :data:`READY_FILE` exists (or when there is none); stays True."""
    global _seen_ready
    _seen_ready = _seen_ready or READY_FILE is None or os.path.exists(READY_FILE)
    return _seen_ready

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
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == READY_PATH:
            ready = is_ready()
            content = {"ready": ready, "waiting": "" if ready else WAITING}
            if ready and scope.get("query_string"):
                content["key"] = key_status(scope)
            await answer(send, 200 if ready else 503, content)
        elif scope["type"] == "http" and not allowed(path, scope.get("client")):
            await answer(send, 403, {"detail": "fedllm: the Control and Runtime APIs of this SuperLink answer only its "
                                               "own machine (127.0.0.1); use flwr on the SuperLink's machine or "
                                               "through an SSH tunnel to it"})
        elif path.startswith("/v1/fleet/") and not is_ready():  # Flower's SuperNode retries a 503
            await answer(send, 503, {"detail": f"fedllm: this SuperLink is {WAITING}; ask again"})
        else:
            await self.app(scope, receive, send)


def key_status(scope: Scope) -> str:
    """The status of the node key ``?key=HEX`` (its bytes as ``flwr supernode register`` sends them) in this
    SuperLink: ``unknown`` (never registered, or unregistered), else Flower's node status (``online``: a session
    holds it; ``offline``, ``registered``); empty when it cannot be read. It tells a refused SuperNode why."""
    from urllib.parse import parse_qs

    try:
        key = bytes.fromhex(parse_qs(scope["query_string"].decode())["key"][0])
        state = scope["app"].state.linkstate_factory.state()
        node_id = state.get_node_id_by_public_key(key)
        if node_id is None:
            return "unknown"
        infos = state.get_node_info(node_ids=[node_id])
        return str(infos[0].status) if infos else "unknown"
    except Exception:  # noqa: BLE001 — no key asked, or a state this Flower keeps otherwise
        return ""


async def answer(send: Send, status: int, content: dict) -> None:
    """Send ``content`` as a JSON response with ``status``."""
    body = json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class PromptShutdown:
    """The ``uvicorn`` module as Flower's SuperLink entry sees it: :func:`uvicorn.run` with
    ``timeout_graceful_shutdown`` set to :data:`GRACEFUL_SHUTDOWN_S`; every other attribute is uvicorn's own."""

    def __getattr__(self, name: str):
        import uvicorn

        return getattr(uvicorn, name)

    @staticmethod
    def run(*args, **kwargs):
        import uvicorn

        kwargs.setdefault("timeout_graceful_shutdown", GRACEFUL_SHUTDOWN_S)
        return uvicorn.run(*args, **kwargs)


def prompt_shutdown(module) -> None:
    """Make ``module`` (``flwr.superlink.cli.flower_superlink``, which imported ``uvicorn``) stop within
    :data:`GRACEFUL_SHUTDOWN_S` of SIGTERM whatever connections are open."""
    module.uvicorn = PromptShutdown()


def install_guard() -> None:
    """Put :class:`OperatorOnly` first in the middleware Flower's SuperLink app is built with, then
    :class:`~fedllm.flower.whole_body.WholeBody` (a request it lets through reaches Flower's layers with its body in
    one message)."""
    from flwr.superlink import extensions
    from starlette.middleware import Middleware

    from fedllm.flower.whole_body import WholeBody

    flower_own = extensions.get_middleware
    extensions.get_middleware = lambda: (Middleware(OperatorOnly), Middleware(WholeBody), *flower_own())


def main(argv: list[str] | None = None) -> None:
    """``flower-superlink`` with :class:`OperatorOnly` and umask 077 (``argv``: its arguments, and fedllm's own
    ``--fedllm-ready-file FILE``)."""
    global READY_FILE
    args = list(sys.argv[1:] if argv is None else argv)
    if "--fedllm-ready-file" in args:
        at = args.index("--fedllm-ready-file")
        READY_FILE = args[at + 1]
        del args[at:at + 2]
    os.umask(0o077)
    for internal in ("FLWR_INTERNAL_GRPC_CONTROL_API", "FLWR_INTERNAL_GRPC_FLEET_API"):  # gRPC servers: unguarded
        os.environ.pop(internal, None)
    install_guard()
    tolerate_stalls()
    from flwr.superlink.cli import flower_superlink

    prompt_shutdown(importlib.import_module("flwr.superlink.cli.flower_superlink"))  # the package exports the function
    sys.argv = ["flower-superlink", *args]
    sys.exit(flower_superlink())


if __name__ == "__main__":
    main()
