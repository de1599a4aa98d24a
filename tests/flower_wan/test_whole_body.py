"""A request's body reaches Flower's HTTP middleware in one message (fedllm/flower/whole_body.py), on fedllm's
SuperLink and SuperNode."""

import asyncio

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import Response
from starlette.routing import Route

from fedllm.flower.whole_body import WholeBody

PIECE, PIECES = 16 * 1024, 320  # a 5 MiB object as the WAN proxy delivers it


def _scope(kind="http"):
    return {"type": kind, "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "path": "/x",
            "raw_path": b"/x", "query_string": b"", "headers": [], "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 2), "scheme": "http", "root_path": ""}


def _server(messages):
    """The server's ``receive``: ``messages`` in order, then a disconnect; and the list of what it handed out."""
    given = []

    async def receive():
        message = messages.pop(0) if messages else {"type": "http.disconnect"}
        given.append(message)
        return message

    return receive, given


def _pieces(n, size):
    return [{"type": "http.request", "body": bytes([i % 251]) * size, "more_body": i < n - 1} for i in range(n)]


def _seen_by(app_below, scope, messages):
    """What the app below :class:`WholeBody` receives, in order (it asks twice: its body, then whatever follows)."""
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())

    receive, given = _server(messages)
    asyncio.run(WholeBody(app)(scope, receive, lambda m: asyncio.sleep(0)))
    return seen, given


def test_a_body_in_pieces_reaches_the_app_as_one_message_and_what_follows_passes_through():
    pieces = _pieces(5, 7)
    body = b"".join(p["body"] for p in pieces)
    seen, given = _seen_by(None, _scope(), list(pieces))
    assert seen == [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    assert len(given) == 6  # the 5 pieces, then the disconnect asked for by the app's second receive


def test_a_disconnect_before_the_body_is_complete_is_handed_on_as_it_came():
    seen, _ = _seen_by(None, _scope(), _pieces(3, 4)[:2] + [{"type": "http.disconnect", "reason": "cut"}])
    assert seen[0] == {"type": "http.disconnect", "reason": "cut"}


def test_other_scopes_get_the_servers_own_receive():
    got = []

    async def app(scope, receive, send):
        got.append(receive)

    receive, given = _server([{"type": "lifespan.startup"}])
    asyncio.run(WholeBody(app)(_scope("lifespan"), receive, None))
    assert got == [receive] and given == []  # nothing read on the app's behalf


def test_behind_starlettes_middleware_the_handler_reads_the_whole_body_from_one_message():
    """Flower's SuperLink stacks eight BaseHTTPMiddleware; each works per message it passes on."""
    reached, handled = [], []

    async def handler(request):
        handled.append(await request.body())
        return Response(str(len(handled[-1])))

    async def passthrough(request, call_next):
        return await call_next(request)

    inner = Starlette(routes=[Route("/x", handler, methods=["POST"])],
                      middleware=[Middleware(BaseHTTPMiddleware, dispatch=passthrough)] * 3)

    async def counting(scope, receive, send):  # what reaches Flower's layers: one message for the body
        async def counted():
            message = await receive()
            reached.append(message["type"])
            return message
        await inner(scope, counted, send)

    pieces = _pieces(PIECES, PIECE)
    body = b"".join(p["body"] for p in pieces)
    sent = []

    async def send(message):
        sent.append(message)

    async def call():
        receive, _ = _server(pieces)
        await WholeBody(counting)(_scope(), receive, send)

    asyncio.run(call())
    assert handled == [body] and len(body) == 5 * 2**20
    assert reached[0] == "http.request" and reached.count("http.request") == 1
    assert sent[0]["status"] == 200 and b"".join(m.get("body", b"") for m in sent[1:]) == str(len(body)).encode()


def test_fedllms_superlink_and_supernode_put_it_in_front_of_flowers_layers(monkeypatch):
    from flwr.superlink import extensions

    from fedllm.flower import superlink, supernode

    monkeypatch.setattr(extensions, "get_middleware", lambda: ["flower's own"])
    superlink.install_guard()
    assert [getattr(m, "cls", m) for m in extensions.get_middleware()] == [
        superlink.OperatorOnly, WholeBody, "flower's own"]  # a refused request is never read

    import flwr.supernode.main as node_app

    monkeypatch.setattr(node_app, "create_app", node_app.create_app)  # restored after the test
    supernode.whole_bodies(node_app)
    app = node_app.create_app()
    assert app.user_middleware[0].cls is WholeBody  # outermost: Flower's own layers are inside it
