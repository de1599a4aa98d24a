"""fedllm's SuperLink and SuperNode keep a running task through PATIENCE heartbeat intervals without a heartbeat."""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest

from fedllm.flower import task_patience


@pytest.fixture
def patched():
    stores = [importlib.import_module(name) for name in task_patience.MODULES]
    before = [store.HEARTBEAT_PATIENCE for store in stores]
    task_patience.tolerate_stalls()
    yield
    for store, value in zip(stores, before, strict=True):
        store.HEARTBEAT_PATIENCE = value


def running_task_ttl() -> timedelta:
    """How long Flower's in-memory task store (a SuperNode's, the same code as the SuperLink's) keeps a task it just
    activated and heard from, without another heartbeat."""
    from flwr.supercore.date import now
    from flwr.supercore.object_store import ObjectStoreFactory
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    state = InMemoryNodeState(ObjectStoreFactory().store())
    task_id = state.create_task("serverapp", run_id=1)
    assert state.claim_task(task_id) and state.activate_task(task_id)
    activated = now()
    assert state.acknowledge_task_heartbeat(task_id)
    return state.task_token_store[task_id].active_until - activated


def test_flower_task_patience_is_two_intervals_without_fedllm():
    from flwr.common.constant import HEARTBEAT_DEFAULT_INTERVAL, HEARTBEAT_PATIENCE

    assert (HEARTBEAT_PATIENCE, HEARTBEAT_DEFAULT_INTERVAL) == (2, 30)  # Flower 1.42: what the module docs describe
    assert timedelta(seconds=59) < running_task_ttl() <= timedelta(seconds=61)


def test_flower_task_patience_fedllm_keeps_a_silent_task_three_minutes(patched):
    assert timedelta(seconds=179) < running_task_ttl() <= timedelta(seconds=181)


def test_flower_task_patience_refuses_a_flower_without_the_constant(monkeypatch):
    store = importlib.import_module(task_patience.MODULES[0])
    monkeypatch.delattr(store, "HEARTBEAT_PATIENCE")
    with pytest.raises(RuntimeError, match="has no HEARTBEAT_PATIENCE"):
        task_patience.tolerate_stalls()
