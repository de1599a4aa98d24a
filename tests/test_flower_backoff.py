"""The ServerApp's collect loop and the SuperNode's idle pulls: quick after an event, doubling while nothing comes
(waits recorded through an injected sleep; no Flower process, no timing)."""

from types import SimpleNamespace

import pytest

from fedllm.flower import supernode
from fedllm.flower.backoff import Backoff
from fedllm.flower.executor import FlowerExecutor


def test_waits_double_up_to_the_cap_and_start_again_after_a_reset():
    slept = []
    wait = Backoff(0.02, 0.25, sleep=slept.append)
    for _ in range(6):
        wait.wait()
    wait.reset()
    wait.wait()
    assert slept == [0.02, 0.04, 0.08, 0.16, 0.25, 0.25, 0.02]


@pytest.mark.parametrize("first, cap", [(0.0, 0.25), (0.5, 0.25), (-0.1, 1.0)])
def test_a_backoff_that_cannot_start_or_cannot_grow_is_refused(first, cap):
    with pytest.raises(ValueError, match=f"first={first}, cap={cap}"):
        Backoff(first, cap)


class ScriptedGrid:
    """A grid whose ``pull_messages`` answers, call after call, with the replies ``script`` lists (ids of the
    messages replied to); it records every pull."""

    def __init__(self, script: list[list[str]]):
        self.script, self.pulls = list(script), 0

    def push_messages(self, messages):
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, ids):
        self.pulls += 1
        replied = self.script.pop(0) if self.script else []
        assert set(replied) <= set(ids)  # never a reply to a message already collected
        return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i), has_error=lambda: False)
                for i in replied]


def collect(script: list[list[str]], messages: int) -> tuple[list[float], list, ScriptedGrid]:
    slept: list[float] = []
    grid = ScriptedGrid(script)
    executor = FlowerExecutor(grid, poll_s=0.25, first_poll_s=0.02, sleep=slept.append)
    sent = [SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for n in range(messages)]
    return slept, executor.send(sent, timeout=3600), grid


def test_the_server_asks_quickly_after_its_push_and_again_after_each_reply():
    # pulls 1-3 find nothing, pull 4 brings m0, pull 5 nothing, pull 6 brings m1: 0.02 s after the push, doubling,
    # and after m0 from 0.02 s again; no wait once every reply is in
    slept, replies, grid = collect([[], [], [], ["m0"], [], ["m1"]], 2)
    assert slept == [0.02, 0.04, 0.08, 0.02, 0.04]
    assert [r.metadata.reply_to_message_id for r in replies] == ["m0", "m1"] and grid.pulls == 6


def test_while_nodes_train_the_server_asks_at_most_every_poll_s():
    slept, replies, grid = collect([[]] * 8 + [["m0", "m1"]], 2)
    assert slept == [0.02, 0.04, 0.08, 0.16, 0.25, 0.25, 0.25, 0.25]
    assert len(replies) == 2 and grid.pulls == 9


def test_all_replies_in_the_first_pull_cost_no_wait():
    slept, replies, _ = collect([["m0", "m1", "m2"]], 3)
    assert slept == [] and len(replies) == 3


def test_within_ten_seconds_of_a_message_the_supernode_asks_at_least_every_200_ms(monkeypatch):
    """After a message the next stage of the round is coming (when the slowest node has answered): the idle pulls
    double from 20 ms to 0.2 s only; ten seconds after the last message, on to 0.5 s (an idle node's rate)."""
    now, slept = [100.0], []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(supernode.time, "sleep", sleep)
    waits = supernode.QuickWaits(clock=lambda: now[0])
    waits.message_came()
    while now[0] < 100.0 + supernode.RUN_WINDOW_S:
        waits.sleep(supernode.FLOWER_IDLE_POLL_S)
    assert slept[:6] == [0.02, 0.04, 0.08, 0.16, 0.2, 0.2] and set(slept[4:]) == {0.2}
    assert len(slept) == 4 + 49  # 0.3 s of doubling, then 9.7 s at 0.2 s: the window's last pull at 100 + 10.1 s
    slept.clear()
    for _ in range(3):
        waits.sleep(supernode.FLOWER_IDLE_POLL_S)
    assert slept == [0.2, 0.4, 0.5]  # out of the window: doubling on to an idle node's 0.5 s
    waits.message_came()
    waits.sleep(supernode.FLOWER_IDLE_POLL_S)
    assert slept[-1] == 0.02
