"""A request's body handed to Flower's HTTP app as one message, not as the pieces the socket delivered.

Flower 1.42's SuperLink app (``flwr/superlink/main.py``, ``_get_middleware``) stacks eight of Starlette's
``BaseHTTPMiddleware``; each one wraps the ASGI ``receive`` of the layers inside it and, for every message it passes
on, starts an anyio task group (``receive_or_disconnect``). uvicorn delivers a request body as the pieces the socket
read: a 5 MiB object pushed over a slow link arrives in hundreds of them (16 KiB each through
:mod:`fedllm.flower.wan_proxy`, whatever the sender's TCP segments amounted to when the SuperLink read on a real
link), so the stack's work grew with the number of pieces, not with the bytes: 493 ms of CPU for one 5 MiB body in
320 pieces of 16 KiB through eight such layers, 20 ms with the body handed on whole (144 and 17 ms in pieces of 64
KiB; ``bench/asgi_body_pieces.py``, load 9 on 2 cores). The 7B recipe's round moves 65 such objects into the
SuperLink (13 from each of 4 nodes, 13 from the ServerApp): with the body whole, ``bench/wan_rounds.py --payload
7b`` took 860 CPU-seconds instead of 1042 for the same 4 runs of 2 rounds, and its loopback round 57 s instead of
101 s (docs/flower.md, "The 7B payload's round").

:class:`WholeBody` reads the body first and gives the app one ``http.request`` message holding all of it; a
disconnect before the body is complete is handed on as it came. The memory is what Starlette's ``Request.body()``
held already (every Flower endpoint reads its whole protobuf body before answering). fedllm's SuperLink puts it just
inside :class:`fedllm.flower.superlink.OperatorOnly` (a refused request is never read), and fedllm's SuperNode in
front of its Runtime API (its node worker's replies, 2 of Flower's layers).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


async def read_body(receive: Receive) -> Message:
    """The request's body as one ``http.request`` message, or the message that ended it early (a disconnect)."""
    pieces = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return message
        pieces.append(message.get("body", b""))
        if not message.get("more_body", False):
            return {"type": "http.request", "body": b"".join(pieces), "more_body": False}


class WholeBody:
    """ASGI middleware: the app below receives an HTTP request's body in one message (module docstring); every later
    ``receive`` (a disconnect while it answers) and every other kind of scope pass through."""

    def __init__(self, app: App):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        first: list[Message] = [await read_body(receive)]

        async def receive_whole() -> Message:
            return first.pop() if first else await receive()

        await self.app(scope, receive_whole, send)
