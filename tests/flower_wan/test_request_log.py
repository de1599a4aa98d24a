"""The request log's reading of a SuperNode's Fleet API requests (fedllm/flower/request_log.py), on hand-made timings
and on bytes as a proxy forwards them."""

import pytest

from fedllm.flower.request_log import Request, RequestLog, serial_round_trips, transfers
from fedllm.flower.wan_proxy import DOWN, UP

ONE_WAY = 0.15  # s each way: a round trip is 0.3 s


def _request(path, sent, connection=0):
    """A request the SuperLink answers at once: its answer reaches the node one round trip after it left."""
    return Request(connection, path, sent, answered=sent + 2 * ONE_WAY, latency_s=ONE_WAY)


def _two_at_a_time(start, path, n):
    return [_request(path, start + 0.3 * (i // 2) + 0.001 * (i % 2), i % 2) for i in range(n)]


def test_requests_sent_together_cost_one_round_trip_and_a_pool_of_2_costs_n_over_2():
    assert serial_round_trips([_request("pull-object", 0.002 * i, i) for i in range(7)]) == 1
    assert serial_round_trips(_two_at_a_time(0.0, "pull-object", 6)) == 3
    assert serial_round_trips(_two_at_a_time(0.0, "pull-object", 7)) == 4
    # one request sent 0.2 s after another left (before its answer came back) does not wait for it
    assert serial_round_trips([_request("a", 0.0), _request("b", 0.2)]) == 1
    assert serial_round_trips([]) == 0
    # 3 objects on open connections and 3 that open theirs (one round trip of handshake before their bytes leave)
    opening = [_request("pull-object", 0.3 + 0.001 * i, 3 + i) for i in range(3)]
    for r in opening:
        r.opening_s = 2 * ONE_WAY
    assert serial_round_trips([_request("pull-object", 0.001 * i, i) for i in range(3)] + opening) == 2


def test_transfers_are_a_received_message_and_a_sent_reply_heartbeats_and_idle_polls_aside():
    t = 0.0
    log = [_request("pull-messages", t), _request("pull-messages", t + 0.4)]  # an empty poll, then the message
    log += [_request("pull-object", t + 0.7 + 0.001 * i, i) for i in range(6)]
    log += [_request("send-node-heartbeat", t + 0.8, 9), _request("confirm-message-received", t + 1.0)]
    log += [_request("push-messages", t + 5.0)] + _two_at_a_time(5.3, "push-object", 5)
    log += [_request("pull-messages", t + 6.3), _request("pull-messages", t + 6.7)]  # polls after the reply
    log += [_request("pull-messages", t + 7.0), _request("pull-object", t + 7.3)]  # cut off: no confirmation yet
    got = transfers(log)
    assert [(x.kind, x.objects, x.round_trips, x.object_round_trips) for x in got] == [
        ("receive", 6, 3, 1), ("send", 5, 4, 3)]
    assert abs(got[0].seconds - 0.9) < 1e-9  # from the poll leaving at 0.4 to the confirmation's answer at 1.3
    assert abs(got[1].seconds - 1.2) < 1e-9  # from 5.0 to the 5th object's answer (it left at 5.9) at 6.2
    assert [(x.start, x.end) for x in got] == [(0.4, pytest.approx(1.3)), (5.0, pytest.approx(6.2))]  # the same ends


def test_the_log_reads_request_lines_and_dates_answers_by_the_down_latency():
    class Proxy:
        links = {UP: type("L", (), {"latency_ms": 100.0})(), DOWN: type("L", (), {"latency_ms": 150.0})()}
        handshake = True

    clock = iter([1.0, 1.1, 1.2, 1.3, 1.35, 1.4]).__next__
    log = RequestLog(Proxy(), clock=clock)
    log(0, UP, b"POST /api/v0/fleet/pull-object HTTP/1.1\r\nhost: x\r\n\r\nbody")
    log(1, UP, b"POST /api/v0/fleet/pull-object HTTP/1.1\r\n\r\n")
    log(0, DOWN, b"HTTP/1.1 200 OK\r\n\r\n")  # connection 0's answer, read at 1.2
    log(0, DOWN, b"more of the same answer")  # not a new answer
    log(2, DOWN, b"HTTP/1.1 200 OK\r\n\r\n")  # a connection with no request: nothing
    done = log.take()
    assert [(r.connection, r.path, r.sent, r.answered) for r in done] == [(0, "pull-object", 1.0, 1.2 + 0.15)]
    assert [r.connection for r in log.requests] == [1]  # still waiting for its answer
    assert done[0].opening_s == 0.25 and done[0].begun == 0.75  # it opened connection 0: a round trip before
    log(0, UP, b"POST /api/v0/fleet/confirm-message-received HTTP/1.1\r\n\r\n")  # connection 0 again, at 1.4
    assert log.requests[-1].opening_s == 0.0
