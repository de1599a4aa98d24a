"""fedllm's SuperNode without Flower's fixed waits, and the worker woken instead of polling (no Flower process)."""

import inspect
import time
import types

import pytest

from fedllm.flower import supernode, wake


def test_the_waits_replaced_are_still_flowers_literals():
    """QuickWaits recognises Flower's waits by their values: if Flower 1.42's loop changes them, this fails."""
    from flwr.supernode import start_client_internal as sci

    loop = inspect.getsource(sci.start_client_internal)
    push = inspect.getsource(sci._push_messages)
    assert f"time.sleep({supernode.FLOWER_IDLE_POLL_S})" in loop
    assert push.count(f"time.sleep({supernode.FLOWER_REPLY_POLL_S})") == 2
    assert sci.time is time  # the module attribute QuickWaits stands in for


def test_idle_polls_start_quick_double_to_the_cap_and_restart_after_a_message(monkeypatch):
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    waits = supernode.QuickWaits()
    for _ in range(7):
        waits.sleep(3)
    waits.message_came()
    waits.sleep(3)
    waits.sleep(0.5)
    waits.sleep(1.25)  # any other wait is Flower's own
    assert slept == [0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5, 0.02, 0.02, 1.25]
    assert waits.monotonic is time.monotonic  # everything else passes through


def test_a_stored_message_wakes_the_worker_holding_the_secret():
    secret, other = b"s" * 32, b"t" * 32
    stored = iter([None, 7])
    module = types.SimpleNamespace(_pull_and_store_message=lambda **kw: next(stored), time=time)
    waits = supernode.quick_supernode(module, secret)
    assert module.time is waits and module.pull_objects.keywords == {"initial_backoff": 0.05, "backoff_cap": 0.5}
    worker, stranger = wake.Wakeup(secret), wake.Wakeup(other)
    try:
        waits.idle.next_s = 0.4
        assert module._pull_and_store_message(state=None) is None  # nothing stored: no wake, no reset
        assert waits.idle_s == 0.4 and worker.wait(0.05) is False
        assert module._pull_and_store_message(state=None) == 7
        assert waits.idle_s == supernode.IDLE_FIRST_S
        t0 = time.monotonic()
        assert worker.wait(5.0) is True and time.monotonic() - t0 < 1.0
        assert stranger.wait(0.05) is False  # another worker's socket is not woken
        assert worker.wait(0.05) is False  # the wake was consumed
    finally:
        worker.close()
        stranger.close()


def test_wakes_queued_while_busy_are_consumed_by_one_wait():
    secret = b"q" * 32
    worker = wake.Wakeup(secret)
    try:
        for _ in range(3):
            wake.notify(secret)
        assert worker.wait(1.0) is True and worker.wait(0.05) is False
    finally:
        worker.close()
    wake.notify(secret)  # nobody listening: nothing happens


def test_a_second_worker_with_the_same_secret_falls_back_to_polling():
    secret = b"d" * 32
    first, second = wake.Wakeup(secret), wake.Wakeup(secret)
    try:
        assert first.sock is not None and second.sock is None
        t0 = time.monotonic()
        assert second.wait(0.1) is False and time.monotonic() - t0 >= 0.1
    finally:
        first.close()


@pytest.mark.parametrize("args", [["--superexec-auth-secret-file", "{f}"], ["--superexec-auth-secret-file={f}"]])
def test_the_supernode_reads_the_worker_secret_from_its_arguments(tmp_path, args):
    f = tmp_path / "secret"
    f.write_bytes(b"k" * 32)
    argv = ["--superlink", "x:1", *[a.format(f=f) for a in args], "--insecure"]
    assert supernode.worker_secret(argv) == b"k" * 32
    assert supernode.worker_secret(["--insecure"]) is None
    assert supernode.worker_secret(["--superexec-auth-secret-file", str(tmp_path / "gone")]) is None


def test_workers_on_one_machine_are_counted_by_their_wake_sockets():
    before = wake.listening_workers()  # other workers may run on this machine
    first, second = wake.Wakeup(b"1" * 32), wake.Wakeup(b"2" * 32)
    try:
        assert wake.listening_workers() == before + 2 and wake.local_workers() == before + 2
    finally:
        first.close()
        second.close()
    assert wake.listening_workers() == before


@pytest.mark.parametrize("source,workers,expected", [("auto", 2, 1), ("auto", 1, 2), ("auto", 5, 1),
                                                     ("OMP_NUM_THREADS", 2, 2), ("FEDLLM_THREADS", 2, 2)])
def test_workers_share_the_cores_unless_the_user_chose_a_thread_count(monkeypatch, source, workers, expected):
    import torch

    from fedllm.common import threads
    from fedllm.flower import runtime

    monkeypatch.setattr(threads, "chosen", lambda: threads.ThreadPolicy(2, source, {}, "user", 2, 1))
    monkeypatch.setattr(wake, "local_workers", lambda: workers)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runtime.share_cores()
        assert torch.get_num_threads() == expected
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("recipe_threads,server_threads,expected", [(None, 3, 3), (2, 3, 2), (None, None, None)])
def test_the_nodes_train_with_the_runs_thread_count(tiny_recipe, monkeypatch, recipe_threads, server_threads, expected):
    """The recipe the ServerApp sends its nodes carries the run's CPU thread count (the recipe's, else the
    ServerApp's: what ``fedllm train`` uses on its machine), which fixes the run's floating-point results; a node
    built from it trains with that count whatever its own default."""
    import torch
    import yaml

    from fedllm.common import threads
    from fedllm.flower.adapter import recipe_for_nodes
    from fedllm.recipe.checks import parse_recipe

    policy = None if server_threads is None else threads.ThreadPolicy(server_threads, "auto", {}, "user", 2, 1)
    monkeypatch.setattr(threads, "chosen", lambda: policy)
    recipe = parse_recipe(tiny_recipe(train={"local_steps": 1, "threads": recipe_threads}))
    sent = yaml.safe_load(recipe_for_nodes(recipe))
    assert sent["train"]["threads"] == expected
    assert recipe.train.threads == recipe_threads  # the server's own recipe (its run directory's) is unchanged
    if expected is None:
        return
    import os

    from fedllm.flower.node import Node

    previous = torch.get_num_threads()
    saved = ({v: os.environ.get(v) for v in threads.THREAD_VARS + threads.WAIT_VARS}, threads._chosen,
             dict(threads._set_by_us))  # threads.apply sets them for this process: put back for the tests after
    try:
        torch.set_num_threads(1)
        node = Node.__new__(Node)
        node.recipe = parse_recipe(sent)
        monkeypatch.delenv(threads.ENV_THREADS, raising=False)
        node.use_threads()
        assert torch.get_num_threads() == expected
        monkeypatch.setenv(threads.ENV_THREADS, "1")  # this machine's own choice wins, said once
        node.use_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
        for var, value in saved[0].items():
            os.environ.pop(var, None) if value is None else os.environ.__setitem__(var, value)
        threads._chosen, threads._set_by_us = saved[1], saved[2]
