"""CPU of one 5 MiB request body through Starlette's ``BaseHTTPMiddleware`` layers, delivered in pieces, with and
without :class:`fedllm.flower.whole_body.WholeBody` in front (docs/flower.md, "The 7B payload's round").

Flower 1.42's SuperLink app stacks eight such layers (``flwr/superlink/main.py``, ``_get_middleware``); one of them
reads the body (its protobuf translation). Here: seven pass-through layers and one that reads the body, a handler that
reads it again, driven directly over ASGI (no socket), 10 requests per row.

    python bench/asgi_body_pieces.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from starlette.applications import Starlette  # noqa: E402 (after the path)
from starlette.middleware import Middleware  # noqa: E402
from starlette.middleware.base import BaseHTTPMiddleware  # noqa: E402
from starlette.responses import Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from fedllm.flower.whole_body import WholeBody  # noqa: E402

BODY = 5 * 2**20
REQUESTS = 10


async def passthrough(request, call_next):
    return await call_next(request)


class ReadsBody(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        await request.body()
        return await call_next(request)


async def handler(request):
    return Response(str(len(await request.body())))


def flower_like() -> Starlette:
    layers = [Middleware(BaseHTTPMiddleware, dispatch=passthrough)] * 4 + [Middleware(ReadsBody)]
    layers += [Middleware(BaseHTTPMiddleware, dispatch=passthrough)] * 3
    return Starlette(routes=[Route("/x", handler, methods=["POST"])], middleware=layers)


async def one_request(app, pieces: int, size: int) -> bytes:
    given = 0

    async def receive():
        nonlocal given
        if given < pieces:
            given += 1
            return {"type": "http.request", "body": b"x" * size, "more_body": given < pieces}
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": "/x",
             "raw_path": b"/x", "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "scheme": "http", "root_path": ""}
    await app(scope, receive, send)
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def main() -> None:
    app = flower_like()
    for name, asgi in (("8 layers", app), ("WholeBody + 8 layers", WholeBody(app))):
        for size in (16 * 1024, 64 * 1024):
            pieces = BODY // size
            start = time.process_time()
            for _ in range(REQUESTS):
                answer = asyncio.run(one_request(asgi, pieces, size))
            assert answer == str(BODY).encode(), answer
            cpu = (time.process_time() - start) / REQUESTS
            print(f"{name:22s} 5 MiB in {pieces:3d} pieces of {size // 1024:2d} KiB: {cpu * 1e3:6.1f} ms CPU "
                  "per request")


if __name__ == "__main__":
    main()
