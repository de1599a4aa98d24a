"""A SuperNode receiving a message of a run its SuperLink no longer holds gives up at once (issue 49, item 8).

Flower 1.42's real SuperNode message path (``_pull_and_store_message`` as :func:`fedllm.flower.supernode.
quick_supernode` patches it) and its real Fleet connection pull from a real in-memory ``flower-superlink``:

- a run the SuperLink does not hold (never had, or no longer has): the SuperLink answers the pull with an error
  (500), not "not available yet", and the node fails that message's task after one pull per object puller instead
  of retrying each object up to ``PULL_MAX_TRIES_PER_OBJECT`` (500) times;
- a node whose session the SuperLink no longer knows (a SuperLink restarted without its database knows neither the
  node nor its runs): the pull is refused (401) and Flower's connection signals its own SuperNode to shut down
  (SIGINT), after which ``fedllm flower supernode`` starts it again (:mod:`fedllm.flower.rejoin`).

A run that still exists and whose objects are still being uploaded keeps being pulled to the end (the last test,
with fedllm's quick pull backoff). The orphaned runs of a SuperLink restarted on its database are
stopped as it starts (:mod:`fedllm.flower.restart`; tests/test_flower_deployment.py), after which the same pull is
refused as for any stopped run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types

import pytest
from flower_cluster import free_port, port_open, wait_until

RUN_ID = 424242
"""A run the SuperLink never held."""


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    """A bare in-memory Flower SuperLink (no database) on a free port: its address."""
    root = tmp_path_factory.mktemp("gone-run")
    (root / "secret").write_bytes(os.urandom(32))
    port = free_port()
    log = root / "superlink.log"
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "flower-superlink"), "--insecure",
                             "--host", "127.0.0.1", "--port", str(port), "--isolation", "process",
                             "--superexec-auth-secret-file", str(root / "secret"),
                             "--disable-runtime-dependency-installation"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: port_open(port), 120, "flower-superlink listening", log)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture
def node(superlink, monkeypatch):
    """Flower's Fleet connection of a self-registered node, with its keys, and the SIGINTs Flower's connection sends
    its own process (recorded here instead of delivered)."""
    from flwr.supercore.retry import http_retry
    from flwr.supernode import fleet_http_connection

    keys, signals = [], []
    generate = fleet_http_connection.generate_key_pairs
    monkeypatch.setattr(fleet_http_connection, "generate_key_pairs", lambda: keys.append(generate()) or keys[-1])
    fake_os = types.SimpleNamespace(getpid=os.getpid, kill=lambda pid, sig: signals.append(sig))
    monkeypatch.setattr(http_retry, "os", fake_os)  # a 401: SIGINT to itself, then a wait for the exit
    monkeypatch.setattr(http_retry, "FORCE_EXIT_TIMEOUT_SECONDS", -1)  # ... of 0 s here
    monkeypatch.setattr(fleet_http_connection, "os", fake_os)  # a heartbeat answered 401 does the same
    with fleet_http_connection.http_request_response(superlink, insecure=True) as conn:
        yield types.SimpleNamespace(conn=conn, keys=keys[0], signals=signals, address=superlink)


@pytest.fixture
def pull_and_store(monkeypatch):
    """Flower's ``_pull_and_store_message`` as fedllm's SuperNode runs it (:func:`quick_supernode`)."""
    from flwr.supernode import start_client_internal

    from fedllm.flower.supernode import quick_supernode

    for name in ("pull_objects", "time", "_pull_and_store_message"):
        monkeypatch.setattr(start_client_internal, name, getattr(start_client_internal, name))
    quick_supernode(start_client_internal, None)
    return start_client_internal._pull_and_store_message


def one_message(node_id, monkeypatch):
    """A message of :data:`RUN_ID` for ``node_id`` (5 objects: the message, its content, an array record,
    its array and the array's chunk)."""
    import numpy as np
    from flwr.app import ArrayRecord, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for name, value in (("_run_id", RUN_ID), ("_node_id", 1), ("_task_id", 1)):  # as the ServerApp's task
        monkeypatch.setattr(TaskIdentity, name, value)
    message = Message(RecordDict({"w": ArrayRecord([np.ones(4, dtype=np.float32)])}), dst_node_id=node_id,
                      message_type="train")
    message.metadata.__dict__["_message_id"] = message.object_id
    return message


def receive_one(message, pull_object, get_run=None, get_fab=None):
    """Drive ``_pull_and_store_message`` with ``message`` (:func:`one_message`), the node having received earlier
    messages of its run (the run stored: neither ``get_run`` nor ``get_fab`` is asked): the pulls it made, whether it
    confirmed the message, the task and the message the node holds, and what it returned."""
    from flwr.supercore.inflatable.inflatable_object import get_object_tree
    from flwr.supercore.object_store.in_memory_object_store import InMemoryObjectStore
    from flwr.supercore.run import Run
    from flwr.supernode import start_client_internal
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState

    store = InMemoryObjectStore()
    state = InMemoryNodeState(store)
    state.set_node_id(message.metadata.dst_node_id)
    run = Run.create_empty(RUN_ID)
    run.fab_hash = "f" * 64
    state.store_run(run)
    tree = get_object_tree(message)
    pulls, confirmed = [], []

    def counted_pull(run_id, object_id):
        pulls.append(object_id)
        return pull_object(run_id, object_id)

    stored = start_client_internal._pull_and_store_message(
        state=state, object_store=store, node_config={}, receive=iter([(message, tree)]).__next__, get_run=get_run,
        get_fab=get_fab, pull_object=counted_pull, confirm_message_received=lambda *a: confirmed.append(a),
        trusted_entities=None)
    tasks = state.get_tasks(run_ids=[RUN_ID])
    return types.SimpleNamespace(returned=stored, pulls=pulls, confirmed=confirmed, tasks=tasks,
                                 messages=state.get_messages_legacy(run_ids=[RUN_ID]), store=store)


def assert_task_failed(got):
    from flwr.common.constant import SubStatus

    assert got.returned is None and not got.confirmed
    assert len(got.tasks) == 1 and got.tasks[0].status.sub_status == SubStatus.FAILED
    assert "Pulling message objects failed" in got.tasks[0].status.details
    assert not got.messages  # the message is dropped with its task


def test_a_message_of_a_run_the_superlink_does_not_hold_fails_after_one_pull_per_puller(node, pull_and_store,
                                                                                           monkeypatch):
    from flwr.supercore.constant import FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS

    got = receive_one(one_message(node.conn[0], monkeypatch), node.conn[5], node.conn[3], node.conn[4])
    assert_task_failed(got)
    assert 1 <= len(got.pulls) <= FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS  # not up to 500 tries per object
    assert not node.signals  # the node's session is fine: nothing shuts it down


def test_a_node_the_superlink_no_longer_knows_is_refused_and_shuts_itself_down(node, pull_and_store, monkeypatch):
    """As after a SuperLink restart without its database: the node's key unregistered there."""
    from flwr.proto.fleet_pb2 import DeactivateNodeRequest, UnregisterNodeFleetRequest  # pylint: disable=E0611
    from flwr.supercore.constant import FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS
    from flwr.supernode.fleet_http_client import FleetHttpClient
    from flwr.supernode.node_auth_http_interceptor import NodeAuthHttpInterceptor

    node_id = node.conn[0]
    with FleetHttpClient.from_server_address(node.address, True, None,
                                             interceptors=[NodeAuthHttpInterceptor(*node.keys)]) as client:
        client.DeactivateNode(DeactivateNodeRequest(node_id=node_id))
        client.UnregisterNode(UnregisterNodeFleetRequest(node_id=node_id))
    got = receive_one(one_message(node.conn[0], monkeypatch), node.conn[5], node.conn[3], node.conn[4])
    assert_task_failed(got)
    assert 1 <= len(got.pulls) <= FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS  # its connection retries once, then gives up
    assert signal.SIGINT in node.signals  # the SuperNode ends; fedllm flower supernode starts it again


def test_a_live_run_whose_objects_arrive_slowly_is_pulled_to_the_end(pull_and_store, monkeypatch):
    """Objects still being uploaded ("not available yet" 10 times each, 50 in all) are waited for: the message is stored
    whole and confirmed, its task left to the ClientApp (no pull is given up on a run that exists)."""
    from flwr.common.constant import Status
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, no_object_id_recompute
    from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError
    from flwr.supernode import start_client_internal

    from fedllm.flower import supernode

    monkeypatch.setattr(supernode, "INITIAL_BACKOFF_S", 0.001)  # fedllm's backoff, shortened for the test
    monkeypatch.setattr(supernode, "BACKOFF_CAP_S", 0.002)
    supernode.quick_object_pulls(start_client_internal)  # after pull_and_store: restored with it
    message = one_message(7, monkeypatch)
    with no_object_id_recompute():
        contents = {oid: obj.deflate() for oid, obj in get_all_nested_objects(message).items()}
    not_yet = {oid: 10 for oid in contents}  # each object: 10 answers "not available yet", then its content

    def uploading(run_id, object_id):
        assert run_id == RUN_ID
        if not_yet[object_id]:
            not_yet[object_id] -= 1
            raise ObjectUnavailableError(object_id)
        return contents[object_id]

    got = receive_one(message, uploading)
    assert got.returned == RUN_ID and len(got.confirmed) == 1
    assert len(got.pulls) == 11 * len(contents) == 55
    assert len(got.tasks) == 1 and got.tasks[0].status.status != Status.FINISHED
    assert [m.object_id for m in got.messages] == [got.confirmed[0][1]]
    assert all(got.store.get(oid) == content for oid, content in contents.items())
