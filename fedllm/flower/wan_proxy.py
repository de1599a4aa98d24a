"""A wide-area link made in user space: an asyncio TCP proxy with latency, bandwidth, jitter, stalls and cuts.

The kernel here has no ``netem``, so tests and benches put this proxy between a SuperNode and the SuperLink (or
any TCP client and server on this machine) to see what a federation across the internet costs. Each direction
of a connection is one :class:`Link`:

- **bandwidth**: a token bucket of ``burst_bytes`` filled at ``mbit_s``, one per direction for all the proxy's
  connections together (parallel connections share the link, as on a real one); the proxy reads no faster than the
  bucket drains, so the sender feels the link's rate through TCP's own back-pressure;
- **latency**: every byte is delivered ``latency_ms`` after it left the bucket (one way; a round trip through
  the proxy costs the sum of both directions' latencies);
- **jitter**: each segment (``segment_bytes`` of the stream, by absolute offset) gets an extra delay drawn
  uniformly from ``[0, jitter_ms]``; bytes are never reordered (TCP would not deliver them out of order);
- **loss** as a stall: a segment is lost with probability ``loss`` and delivered ``stall_ms`` later (a
  retransmission), holding everything behind it (head-of-line blocking) and pausing the sender as long (so
  the stalls of a stream add up);
- **connection set-up**: a connection's first bytes up leave one round trip (both latencies) after it was opened,
  as after TCP's handshake (:attr:`WanProxy.handshake`; a TLS handshake, carried as bytes, costs its own round trips);
- **cuts** (:class:`Cut`): after a chosen number of bytes in one direction, or a chosen time, the proxy
  delivers what it promised and then resets the connection (both sides see it closed); later connections pass.

Every random draw comes from a ``random.Random`` seeded with ``(seed, connection number, direction)`` and is made
per segment in stream order, so which bytes stall and how long each waits is the same on every run with the same
seed. The proxy listens on and connects to loopback addresses only.

Run one from a shell (a SuperNode then connects to the proxy's port instead of the SuperLink's)::

    python -m fedllm.flower.wan_proxy --listen 127.0.0.1:9192 --target 127.0.0.1:9092 --latency-ms 40 --mbit 100
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

UP, DOWN = "up", "down"  # client -> server (a SuperNode's upload), server -> client


@dataclass(frozen=True)
class Link:
    """One direction of a wide-area link.

    Attributes:
        latency_ms: one-way delay of every byte, in milliseconds.
        mbit_s: bandwidth in Mbit/s (10^6 bits per second); None: unlimited.
        burst_bytes: the token bucket's depth (what may leave at once after an idle spell).
        jitter_ms: extra delay per segment, uniform in [0, jitter_ms].
        loss: probability that a segment is lost and delivered ``stall_ms`` late.
        stall_ms: what a lost segment costs (a retransmission timeout).
        segment_bytes: the unit of jitter and loss (bytes of the stream, counted from the connection's start).
    """

    latency_ms: float = 0.0
    mbit_s: float | None = None
    burst_bytes: int = 64 * 1024
    jitter_ms: float = 0.0
    loss: float = 0.0
    stall_ms: float = 200.0
    segment_bytes: int = 16 * 1024

    def __post_init__(self) -> None:
        problems = [name for name, ok in (
            ("latency_ms", self.latency_ms >= 0), ("mbit_s", self.mbit_s is None or self.mbit_s > 0),
            ("burst_bytes", self.burst_bytes > 0), ("jitter_ms", self.jitter_ms >= 0),
            ("loss", 0 <= self.loss < 1), ("stall_ms", self.stall_ms >= 0), ("segment_bytes", self.segment_bytes > 0))
            if not ok]
        if problems:
            raise ValueError(f"Link: out of range: {', '.join(f'{p}={getattr(self, p)!r}' for p in problems)}")

    @property
    def bytes_per_s(self) -> float | None:
        """The bandwidth in bytes per second (None: unlimited)."""
        return None if self.mbit_s is None else self.mbit_s * 1e6 / 8


@dataclass(frozen=True)
class Cut:
    """Reset one connection once: the one that carries byte ``at_byte`` of ``direction`` (counted over every
    connection of the proxy), or the one open ``at_s`` seconds after the proxy started."""

    direction: str = UP
    at_byte: int | None = None
    at_s: float | None = None

    def __post_init__(self) -> None:
        if self.direction not in (UP, DOWN) or (self.at_byte is None) == (self.at_s is None):
            raise ValueError(f"Cut needs direction 'up' or 'down' and exactly one of at_byte, at_s; got {self}")


@dataclass
class Stats:
    """What went through the proxy (every connection together)."""

    bytes: dict[str, int] = field(default_factory=lambda: {UP: 0, DOWN: 0})
    connections: int = 0
    stalls: int = 0
    cuts: list[dict] = field(default_factory=list)  # {"connection", "direction", "byte", "at_s"} per cut made


class TokenBucket:
    """Tokens (bytes) filled at ``rate`` per second up to ``depth``; :meth:`take` says when ``n`` bytes may go."""

    def __init__(self, rate: float | None, depth: int, now: float):
        self.rate, self.depth = rate, depth
        self.tokens, self.at = float(depth), now

    def take(self, n: int, now: float) -> float:
        """Spend ``n`` tokens; return the time at which the last of the ``n`` bytes has left (>= now)."""
        if self.rate is None:
            return now
        self.tokens = min(self.depth, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        if self.tokens >= 0:
            return now
        wait = -self.tokens / self.rate
        self.tokens, self.at = 0.0, now + wait
        return now + wait


class Segments:
    """Per-segment draws of jitter and loss, in stream order, from one seeded generator."""

    def __init__(self, link: Link, seed: tuple):
        self.link, self.rng = link, random.Random(repr(seed))
        self.drawn: list[tuple[float, bool]] = []  # (jitter s, lost) of segments 0, 1, ...
        self.charged = -1  # the last segment whose stall was charged

    def delay(self, start: int, end: int) -> tuple[float, int]:
        """``(extra seconds, stalls)`` for the stream bytes ``[start, end)``: the largest jitter among their
        segments plus ``stall_ms`` for each lost segment not charged before."""
        link = self.link
        if not link.jitter_ms and not link.loss:
            return 0.0, 0
        first, last = start // link.segment_bytes, (end - 1) // link.segment_bytes
        while len(self.drawn) <= last:
            jitter = self.rng.uniform(0, link.jitter_ms) / 1e3 if link.jitter_ms else 0.0
            self.drawn.append((jitter, bool(link.loss) and self.rng.random() < link.loss))
        jitter = max(j for j, _ in self.drawn[first:last + 1])
        stalls = sum(lost for _, lost in self.drawn[max(first, self.charged + 1):last + 1])
        self.charged = max(self.charged, last)
        return jitter + stalls * link.stall_ms / 1e3, stalls


def _loopback(host: str, what: str) -> None:
    try:
        ok = ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"WanProxy: {what} {host!r} is not a loopback address (the proxy is for tests and benches)")


class WanProxy:
    """A TCP proxy from ``listen`` to ``target`` whose two directions behave as ``up`` and ``down``.

    Args:
        target: ``(host, port)`` of the server (loopback).
        up: the client -> server direction.
        down: the server -> client direction.
        seed: seeds every random draw (jitter, loss).
        cuts: connections to reset (each once).
        observer: called with ``(connection number, direction, bytes)`` for everything forwarded.
        listen: ``(host, port)`` to listen on; port 0 picks a free one (see :attr:`address`).
    """

    def __init__(self, target: tuple[str, int], up: Link = Link(), down: Link = Link(), seed: int = 0,
                 cuts: tuple[Cut, ...] = (), listen: tuple[str, int] = ("127.0.0.1", 0),
                 observer: Callable[[int, str, bytes], object] | None = None):
        _loopback(target[0], "target")
        _loopback(listen[0], "listen address")
        self.target, self.seed, self.listen = target, seed, listen
        self.links = {UP: up, DOWN: down}  # may be replaced while running: open connections follow
        self.pending_cuts = list(cuts)
        self.observer = observer  # sees (connection, direction, bytes) of everything forwarded (a bench's tap)
        self.stats = Stats()
        self.buckets: dict[str, tuple[Link, TokenBucket]] = {}  # per direction: one for all connections
        self.handshake = True  # a new connection's first bytes up wait one round trip (TCP's handshake)
        self.server: asyncio.base_events.Server | None = None
        self.started = 0.0
        self.open: set[asyncio.Task] = set()

    @property
    def address(self) -> tuple[str, int]:
        """``(host, port)`` the proxy listens on (after :meth:`start`)."""
        return self.server.sockets[0].getsockname()[:2]

    def cut_after(self, direction: str, more_bytes: int) -> None:
        """Reset the connection that carries the byte ``more_bytes`` after what ``direction`` has carried so far (from
        any thread: a test arms it when its process reaches a point)."""
        def arm() -> None:
            self.pending_cuts.append(Cut(direction, at_byte=self.stats.bytes[direction] + more_bytes))
        self.loop.call_soon_threadsafe(arm)

    async def start(self) -> None:
        """Listen (returns once the port is open)."""
        self.loop = asyncio.get_running_loop()
        self.started = time.monotonic()
        self.server = await asyncio.start_server(self._serve, *self.listen)

    async def close(self) -> None:
        """Stop listening and reset every open connection."""
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
        for task in list(self.open):
            task.cancel()
        await asyncio.gather(*self.open, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.open.add(task)
        number = self.stats.connections
        self.stats.connections += 1
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.transport.abort()
            self.open.discard(task)
            return
        writers = (client_w, server_w)
        cut = asyncio.Event()
        pumps = [asyncio.create_task(self._pump(number, UP, client_r, server_w, cut)),
                 asyncio.create_task(self._pump(number, DOWN, server_r, client_w, cut))]
        timer = self._time_cut(number, cut)
        watch = asyncio.create_task(cut.wait())
        try:
            done, _ = await asyncio.wait([*pumps, watch], return_when=asyncio.FIRST_COMPLETED)
            if any(t in pumps and not t.cancelled() and t.exception() is not None for t in done):
                cut.set()  # one end reset its connection: reset the other as well
            if cut.is_set():
                for p in pumps:
                    p.cancel()
            else:  # one side closed: let the other direction finish delivering
                await asyncio.gather(*pumps, return_exceptions=True)
        except asyncio.CancelledError:
            for p in pumps:
                p.cancel()
            cut.set()
        finally:
            watch.cancel()
            if timer is not None:
                timer.cancel()
            for w in writers:
                if cut.is_set():
                    w.transport.abort()  # a reset, as a dropped connection looks to both ends
                else:
                    w.close()
            self.open.discard(task)

    def _time_cut(self, number: int, cut: asyncio.Event) -> asyncio.TimerHandle | None:
        for c in self.pending_cuts:
            if c.at_s is not None:
                delay = max(0.0, self.started + c.at_s - time.monotonic())

                def fire(c: Cut = c) -> None:
                    if c in self.pending_cuts and not cut.is_set():
                        self.pending_cuts.remove(c)
                        self.stats.cuts.append({"connection": number, "direction": c.direction,
                                                "byte": self.stats.bytes[c.direction], "at_s": c.at_s})
                        cut.set()
                return asyncio.get_running_loop().call_later(delay, fire)
        return None

    def _byte_cut(self, direction: str) -> Cut | None:
        return next((c for c in self.pending_cuts if c.direction == direction and c.at_byte is not None), None)

    def _bucket(self, direction: str, link: Link, now: float) -> TokenBucket:
        """``direction``'s token bucket, one for every connection of the proxy: a link's bandwidth is shared by the
        connections over it (a client that moves several objects at once, each on its own connection, gets no more
        of it); a new, full one when the link is replaced."""
        held = self.buckets.get(direction)
        if held is None or held[0] is not link:
            held = self.buckets[direction] = (link, TokenBucket(link.bytes_per_s, link.burst_bytes, now))
        return held[1]

    async def _pump(self, number: int, direction: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    cut: asyncio.Event) -> None:
        """Move one direction: read what the bucket lets go, deliver it ``latency`` (+ jitter, stalls) later."""
        link, loop = self.links[direction], asyncio.get_running_loop()
        bucket = self._bucket(direction, link, loop.time())
        draws = Segments(link, (self.seed, number, direction))
        queue: asyncio.Queue = asyncio.Queue()
        deliver = asyncio.create_task(self._deliver(queue, writer))
        offset, last_due = 0, 0.0
        read_size = max(1, min(link.segment_bytes, link.burst_bytes))
        try:
            if direction == UP and self.handshake:  # SYN, SYN-ACK: the client sends one round trip after connecting
                await asyncio.sleep((self.links[UP].latency_ms + self.links[DOWN].latency_ms) / 1e3)
            while not cut.is_set():
                if self.links[direction] is not link:  # changed between runs (a bench's next profile)
                    link = self.links[direction]
                    bucket = self._bucket(direction, link, loop.time())
                    draws = Segments(link, (self.seed, number, direction, offset))
                    read_size = max(1, min(link.segment_bytes, link.burst_bytes))
                pending = self._byte_cut(direction)
                want = read_size
                if pending is not None:
                    want = max(1, min(want, pending.at_byte - self.stats.bytes[direction]))
                data = await reader.read(want)
                if not data:
                    break
                if deliver.done():  # the receiving end is gone
                    deliver.result()
                    break
                gone = bucket.take(len(data), loop.time())
                if gone > loop.time():
                    await asyncio.sleep(gone - loop.time())  # the sender waits for the link (back-pressure)
                extra, stalls = draws.delay(offset, offset + len(data))
                self.stats.stalls += stalls
                last_due = max(last_due, gone + link.latency_ms / 1e3 + extra)  # never reordered
                queue.put_nowait((last_due, data))
                if stalls:  # the sender waits for the retransmission too: stalls add up, never overlap
                    await asyncio.sleep(stalls * link.stall_ms / 1e3)
                offset += len(data)
                self.stats.bytes[direction] += len(data)
                if self.observer is not None:
                    self.observer(number, direction, data)
                if pending is not None and self.stats.bytes[direction] >= pending.at_byte \
                        and pending in self.pending_cuts:
                    self.pending_cuts.remove(pending)
                    self.stats.cuts.append({"connection": number, "direction": direction,
                                            "byte": self.stats.bytes[direction], "at_s": None})
                    queue.put_nowait(None)
                    await deliver  # what was promised before the cut arrives, then the connection resets
                    cut.set()
                    return
            queue.put_nowait(None)
            await deliver
            if not cut.is_set() and writer.can_write_eof():
                writer.write_eof()
        finally:
            deliver.cancel()

    @staticmethod
    async def _deliver(queue: asyncio.Queue, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await queue.get()
            if item is None:
                return
            due, data = item
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            writer.write(data)
            await writer.drain()


@contextmanager
def running(proxy: WanProxy) -> Iterator[WanProxy]:
    """Run ``proxy`` on its own event loop in a background thread for the ``with`` block (for synchronous
    tests and benches); yields it once it listens."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    failure: list[BaseException] = []

    def serve() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(proxy.start())
        except BaseException as e:  # noqa: BLE001 — reported to the caller below
            failure.append(e)
            ready.set()
            return
        ready.set()
        loop.run_forever()
        loop.run_until_complete(proxy.close())
        loop.close()

    thread = threading.Thread(target=serve, name="wan-proxy", daemon=True)
    thread.start()
    ready.wait()
    if failure:
        raise failure[0]
    try:
        yield proxy
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m fedllm.flower.wan_proxy``: one proxy until interrupted; both directions alike unless the
    ``--up-*`` options say otherwise."""
    p = argparse.ArgumentParser(prog="python -m fedllm.flower.wan_proxy", description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to listen on (loopback)")
    p.add_argument("--target", required=True, help="HOST:PORT to forward to (loopback)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="one-way delay, each direction")
    p.add_argument("--mbit", type=float, default=None, help="bandwidth in Mbit/s, each direction")
    p.add_argument("--up-mbit", type=float, default=None, help="bandwidth client -> server (default: --mbit)")
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--loss", type=float, default=0.0, help="probability that a segment stalls")
    p.add_argument("--stall-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    down = Link(args.latency_ms, args.mbit, jitter_ms=args.jitter_ms, loss=args.loss, stall_ms=args.stall_ms)
    up = Link(args.latency_ms, args.up_mbit or args.mbit, jitter_ms=args.jitter_ms, loss=args.loss,
              stall_ms=args.stall_ms)
    proxy = WanProxy(_host_port(args.target), up, down, args.seed, listen=_host_port(args.listen))

    async def serve() -> None:
        await proxy.start()
        print(f"wan proxy {proxy.address[0]}:{proxy.address[1]} -> {args.target}", flush=True)
        await asyncio.Event().wait()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
