"""The WAN proxy against its own model, on a local echo / sink server (small payloads, delays of tens of ms)."""

import asyncio
import time

import pytest

from fedllm.flower.wan_proxy import DOWN, UP, Cut, Link, Segments, TokenBucket, WanProxy, running


async def _echo(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def _with_proxy(handler, proxy_args, body):
    """Start a server running ``handler`` and a proxy in front of it; ``await body(proxy)``."""
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    proxy = WanProxy(server.sockets[0].getsockname()[:2], **proxy_args)
    await proxy.start()
    try:
        return await body(proxy)
    finally:
        await proxy.close()
        server.close()
        await server.wait_closed()


async def _round_trips(proxy, n, size=100):
    reader, writer = await asyncio.open_connection(*proxy.address)
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        writer.write(b"x" * size)
        await reader.readexactly(size)
        times.append(time.monotonic() - t0)
    writer.close()
    return times


def test_a_round_trip_costs_both_directions_latency():
    up, down = Link(latency_ms=30), Link(latency_ms=20)
    times = asyncio.run(_with_proxy(_echo, {"up": up, "down": down}, lambda p: _round_trips(p, 4)))
    assert min(times) >= 0.050 - 1e-3  # never faster than the model
    assert sorted(times)[1] < 0.050 + 0.040, times  # and close to it (a loaded machine adds scheduling delays)


def test_a_new_connection_costs_a_round_trip_before_its_first_bytes_leave():
    up, down = Link(latency_ms=30), Link(latency_ms=20)

    async def body(proxy):
        t0 = time.monotonic()
        times = await _round_trips(proxy, 2)
        return time.monotonic() - t0, times

    total, times = asyncio.run(_with_proxy(_echo, {"up": up, "down": down}, body))
    assert times[0] >= 2 * 0.050 - 1e-3 and times[1] < 0.050 + 0.040, times  # handshake + round trip; then 1
    assert total >= 3 * 0.050 - 1e-3, total


def test_throughput_follows_the_token_bucket():
    """500 kB up at 8 Mbit/s (1 MB/s) with a 64 KiB bucket: (500 000 - 65 536) / 1e6 s + 10 ms latency."""
    size, link = 500_000, Link(latency_ms=10, mbit_s=8)
    model = (size - link.burst_bytes) / link.bytes_per_s + 0.010

    async def body(proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        t0 = time.monotonic()
        writer.write(b"y" * size)
        await reader.readexactly(size)
        elapsed = time.monotonic() - t0
        writer.close()
        return elapsed

    elapsed = asyncio.run(_with_proxy(_echo, {"up": link}, body))  # down: unlimited
    assert model * 0.97 <= elapsed <= model * 1.3, (elapsed, model)


def test_connections_at_once_share_the_bandwidth():
    """4 connections of 125 kB up at once, 8 Mbit/s, a 64 KiB bucket: the last byte arrives after (500 000 - 65 536)
    / 1e6 s + 10 ms, as for one connection of 500 kB (not a quarter of it: one bucket per connection)."""
    size, link = 125_000, Link(latency_ms=10, mbit_s=8)
    model = (4 * size - link.burst_bytes) / link.bytes_per_s + 0.010

    async def one(proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"y" * size)
        await reader.readexactly(size)
        writer.close()

    async def body(proxy):
        t0 = time.monotonic()
        await asyncio.gather(*(one(proxy) for _ in range(4)))
        return time.monotonic() - t0

    elapsed = asyncio.run(_with_proxy(_echo, {"up": link}, body))
    assert model * 0.97 <= elapsed <= model * 1.3, (elapsed, model)


def test_a_cut_at_byte_n_delivers_exactly_n_bytes_then_resets_both_ends():
    received = bytearray()

    async def body(proxy):
        done = asyncio.Event()

        async def sink(reader, writer):
            try:
                while data := await reader.read(65536):
                    received.extend(data)
            except ConnectionError:
                pass
            done.set()

        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        proxy.target = server.sockets[0].getsockname()[:2]
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"z" * 100_000)
        client_saw = await reader.read()  # EOF or reset, never data
        await asyncio.wait_for(done.wait(), 10)
        done.clear()
        # a second connection passes untouched (the cut happens once)
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"w" * 1000)
        writer.write_eof()
        await asyncio.wait_for(done.wait(), 10)
        server.close()
        return client_saw

    client_saw = asyncio.run(_with_proxy(_echo, {"cuts": (Cut(UP, at_byte=30_000),)}, body))
    assert client_saw == b""
    assert len(received) == 30_000 + 1000 and bytes(received[:30_000]) == b"z" * 30_000


def test_a_cut_at_a_time_resets_the_open_connection():
    async def body(proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        writer.write(b"a")
        await reader.readexactly(1)  # open and flowing before the cut
        t0 = time.monotonic()
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await asyncio.wait_for(reader.readexactly(1), 10)  # nothing more comes; the reset ends the wait
        return time.monotonic() - t0, proxy.stats.cuts

    elapsed, cuts = asyncio.run(_with_proxy(_echo, {"cuts": (Cut(DOWN, at_s=0.2),)}, body))
    assert elapsed < 5 and len(cuts) == 1 and cuts[0]["connection"] == 0


def test_jitter_and_loss_draws_are_the_same_for_a_seed():
    link = Link(jitter_ms=10, loss=0.3, stall_ms=40, segment_bytes=1000)
    a, b, c = Segments(link, (1, 0, UP)), Segments(link, (1, 0, UP)), Segments(link, (2, 0, UP))
    # the same bytes read in different pieces draw the same segments
    pieces_a = [a.delay(s, s + 500) for s in range(0, 20_000, 500)]
    pieces_b = [b.delay(s, min(s + 3000, 20_000)) for s in range(0, 20_000, 3000)]
    c.delay(0, 20_000)
    assert a.drawn == b.drawn and a.drawn != c.drawn and len(a.drawn) == 20
    lost = sum(x for _, x in a.drawn)
    assert sum(s for _, s in pieces_a) == sum(s for _, s in pieces_b) == lost > 0  # each stall charged once
    assert all(0 <= j <= 0.010 for j, _ in a.drawn)


def test_stalls_delay_the_stream_by_their_cost():
    link = Link(latency_ms=5, loss=0.25, stall_ms=30, segment_bytes=2000, burst_bytes=2000)
    size = 40_000

    async def body(proxy):
        reader, writer = await asyncio.open_connection(*proxy.address)
        t0 = time.monotonic()
        writer.write(b"s" * size)
        await reader.readexactly(size)
        writer.close()
        return time.monotonic() - t0, proxy.stats.stalls

    elapsed, stalls = asyncio.run(_with_proxy(_echo, {"up": link, "seed": 7}, body))
    expected = Segments(link, (7, 0, UP))
    expected.delay(0, size)
    assert stalls == sum(x for _, x in expected.drawn) > 0
    assert elapsed >= stalls * 0.030 + 0.005 - 1e-3, (elapsed, stalls)


def test_token_bucket_arithmetic():
    bucket = TokenBucket(rate=1000.0, depth=100, now=0.0)
    assert bucket.take(100, 0.0) == 0.0  # the full bucket goes at once
    assert bucket.take(50, 0.0) == pytest.approx(0.05)  # then at the rate
    assert bucket.take(10, 1.0) == 1.0  # refilled meanwhile (capped at the depth)


def test_only_loopback_and_the_thread_runner():
    with pytest.raises(ValueError, match="not a loopback address"):
        WanProxy(("8.8.8.8", 53))
    with pytest.raises(ValueError, match="exactly one of at_byte, at_s"):
        Cut(UP)

    import socket
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def echo_once():
        conn, _ = listener.accept()
        conn.sendall(conn.recv(10))
        conn.close()

    threading.Thread(target=echo_once, daemon=True).start()
    with running(WanProxy(listener.getsockname(), up=Link(latency_ms=20))) as proxy, \
            socket.create_connection(proxy.address, timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"hello")
        assert s.recv(10) == b"hello"
        assert time.monotonic() - t0 >= 0.019
    listener.close()
