"""The Fleet API requests through a :class:`~fedllm.flower.wan_proxy.WanProxy`, timed: how many round trips a
message costs its SuperNode one after another (a bench's and a test's tap; the proxy's ``observer``).

Each request is seen as it leaves the SuperNode (its request line, ``POST /.../pull-object HTTP/1.1``, at the start
of what the proxy reads upward on a connection: HTTP/1.1 sends one request at a time per connection) and its answer as
the SuperLink sends it (the first bytes downward on that connection after the request); the answer reaches the
SuperNode the link's down latency later. A request *depends on* another when it left after that one's answer had
reached the SuperNode (less half the down latency, so that requests sent together never count as one after the
other); the *serial round trips* of a set of requests are its longest chain of dependent requests. With latency L
each way, requests sent together cost one round trip whatever their number; N objects moved 2 at a time cost N/2. A
request that opens its connection (the first one seen on it) costs one round trip more when the proxy charges TCP's
handshake (:attr:`~fedllm.flower.wan_proxy.WanProxy.handshake`): its bytes left that much after the node began it.

A SuperNode's message, as Flower 1.42 moves it (``flwr/supernode/start_client_internal.py``): received by a
``pull-messages`` that returns it (a ``get-run``/``get-fab`` for a run's first message), one ``pull-object`` per
object and a ``confirm-message-received``; its reply sent by a ``push-messages`` and one ``push-object`` per object
the SuperLink asks for, before the SuperNode's next ``pull-messages``. Heartbeats are left out (their own thread).
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from fedllm.flower.wan_proxy import DOWN, UP

REQUEST_LINE = re.compile(rb"(?:POST|GET|PUT) /[A-Za-z0-9_/\-]*?([a-z\-]+) HTTP/1")
POLL, OBJECT_IN, CONFIRM = "pull-messages", "pull-object", "confirm-message-received"
REPLY, OBJECT_OUT = "push-messages", "push-object"
RUN_INFO = ("get-run", "get-fab")


@dataclass
class Request:
    """One Fleet API request: its path's last part, when it left the SuperNode and when its answer reached it."""

    connection: int
    path: str
    sent: float
    answered: float | None = None  # the first bytes of its answer reach the SuperNode (None: not yet)
    latency_s: float = 0.0  # the down latency when it was answered
    opening_s: float = 0.0  # the first request of its connection: the handshake's round trip before it left

    @property
    def begun(self) -> float:
        """When the SuperNode began it (opened its connection, for the first request of one)."""
        return self.sent - self.opening_s


@dataclass
class Transfer:
    """One message received or one reply sent: its requests and what they cost."""

    kind: str  # "receive" or "send"
    objects: int  # pull-object / push-object requests
    seconds: float  # from the first request leaving to the last answer arriving
    round_trips: int  # serial round trips (module docstring)
    object_round_trips: int  # serial round trips of its object requests alone
    start: float = 0.0  # when its first request was begun (the log's clock)
    end: float = 0.0  # when its last answer reached the SuperNode


class RequestLog:
    """A proxy ``observer`` that times every request through it (thread-safe: the proxy's loop writes, a test reads).

    ``proxy``: the proxy it observes (its down link's latency dates each answer's arrival); set :attr:`proxy` after
    building the proxy when the log is its observer from the start."""

    def __init__(self, proxy=None, clock=time.monotonic):
        self.proxy, self.clock = proxy, clock
        self.lock = threading.Lock()
        self.requests: list[Request] = []
        self.waiting: dict[int, Request] = {}  # connection -> its request not answered yet
        self.connections: set[int] = set()  # those that carried a request

    def __call__(self, connection: int, direction: str, data: bytes) -> None:
        now = self.clock()
        with self.lock:
            if direction == UP:
                for match in REQUEST_LINE.finditer(data):
                    request = Request(connection, match.group(1).decode(), now)
                    if connection not in self.connections and self.proxy is not None and self.proxy.handshake:
                        request.opening_s = sum(link.latency_ms for link in self.proxy.links.values()) / 1e3
                    self.connections.add(connection)
                    self.requests.append(request)
                    self.waiting[connection] = request
            elif connection in self.waiting:
                request = self.waiting.pop(connection)
                request.latency_s = self.proxy.links[DOWN].latency_ms / 1e3 if self.proxy is not None else 0.0
                request.answered = now + request.latency_s

    def take(self) -> list[Request]:
        """The answered requests so far, in the order they left (and forget them)."""
        with self.lock:
            done = [r for r in self.requests if r.answered is not None]
            self.requests = [r for r in self.requests if r.answered is None]
        return sorted(done, key=lambda r: r.sent)


def serial_round_trips(requests: list[Request]) -> int:
    """The longest chain of requests each of which was begun after the previous one's answer had reached the
    SuperNode (less half the down latency: requests sent together are never in one chain); a request that opened its
    connection counts 2 (the handshake, then itself)."""
    ordered = sorted(requests, key=lambda r: r.begun)
    depth: list[int] = []
    for j, later in enumerate(ordered):
        before = [depth[i] for i, r in enumerate(ordered[:j]) if later.begun >= r.answered - r.latency_s / 2]
        depth.append(1 + (later.opening_s > 0) + max(before, default=0))
    return max(depth, default=0)


def _transfer(kind: str, requests: list[Request], object_path: str) -> Transfer:
    objects = [r for r in requests if r.path == object_path]
    start, end = min(r.begun for r in requests), max(r.answered for r in requests)
    return Transfer(kind, len(objects), end - start, serial_round_trips(requests), serial_round_trips(objects),
                    start, end)


def transfers(requests: list[Request]) -> list[Transfer]:
    """The messages received and replies sent among ``requests`` (one SuperNode's, in the order they left), in order;
    a message or reply whose requests are not all there (cut off at either end) is left out."""
    requests = [r for r in requests if r.path != "send-node-heartbeat"]
    out, i = [], 0
    while i < len(requests):
        path = requests[i].path
        if path == POLL:  # a message received: the last poll before its objects, up to its confirmation
            j = i + 1
            while j < len(requests) and requests[j].path in RUN_INFO + (OBJECT_IN,):
                j += 1
            if j < len(requests) and requests[j].path == CONFIRM and j > i + 1:
                out.append(_transfer("receive", requests[i:j + 1], OBJECT_IN))
                i = j + 1
                continue
        elif path == REPLY:  # a reply sent: its objects, up to the next poll
            j = i + 1
            while j < len(requests) and requests[j].path == OBJECT_OUT:
                j += 1
            if j < len(requests):  # the next request shows the reply's objects were all sent
                out.append(_transfer("send", requests[i:j], OBJECT_OUT))
                i = j
                continue
        i += 1
    return out
