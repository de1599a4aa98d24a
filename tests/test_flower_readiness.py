"""A SuperNode started before its SuperLink waits for it; a SuperLink restarted on its database does not register its
node keys again; a refused node is told why (no Flower process here: the guard on ASGI messages, the wait on a fake
clock, the database through Flower's own state; README's commands typed nodes-first: tests/test_flower_readme.py)."""

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedllm.flower import reach, superlink

pytest.importorskip("flwr")


def call(path: str, query: bytes = b"", app_state=None) -> tuple[int, dict | None]:
    """One HTTP request through :class:`OperatorOnly` from a network peer: (status, JSON body; None: passed to
    Flower's app, which answers 299 here)."""
    sent = []

    async def flower(scope, receive, send):
        await send({"type": "http.response.start", "status": 299, "headers": []})

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path, "query_string": query, "client": ("203.0.113.7", 5000),
             "app": SimpleNamespace(state=app_state)}
    asyncio.run(superlink.OperatorOnly(flower)(scope, None, send))
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return sent[0]["status"], json.loads(body) if body else None


def test_the_fleet_api_waits_503_until_the_node_keys_are_registered(tmp_path, monkeypatch):
    ready = tmp_path / "ready"
    monkeypatch.setattr(superlink, "READY_FILE", str(ready))
    monkeypatch.setattr(superlink, "_seen_ready", False)
    assert call("/v1/fleet/activate-node") == (503, {"detail": f"fedllm: this SuperLink is {superlink.WAITING}; "
                                                               "ask again"})
    assert call(superlink.READY_PATH) == (503, {"ready": False, "waiting": superlink.WAITING})
    assert call("/v1/control/start-run")[0] == 403  # the guard first: never "wait" for what the network may not reach
    ready.touch()  # fedllm flower superlink: every node key registered
    assert call("/v1/fleet/activate-node") == (299, None)
    assert call(superlink.READY_PATH) == (200, {"ready": True, "waiting": ""})
    ready.unlink()
    assert call("/v1/fleet/pull-messages") == (299, None)  # once ready, ready for good


def test_a_refused_node_learns_its_keys_status_from_the_superlink(monkeypatch):
    monkeypatch.setattr(superlink, "READY_FILE", None)
    online, gone = b"\x01" * 8, b"\x02" * 8
    state = SimpleNamespace(get_node_id_by_public_key=lambda key: {online: 7}.get(key),
                            get_node_info=lambda node_ids: [SimpleNamespace(status="online")] if node_ids == [7] else [])
    factory = SimpleNamespace(linkstate_factory=SimpleNamespace(state=lambda: state))
    assert call(superlink.READY_PATH, b"key=" + online.hex().encode(), factory)[1]["key"] == "online"
    assert call(superlink.READY_PATH, b"key=" + gone.hex().encode(), factory)[1]["key"] == "unknown"
    assert call(superlink.READY_PATH, b"key=zz", factory)[1]["key"] == ""
    assert "heartbeats time out" in reach.refusal_cause("online")
    assert "flwr supernode unregister" in reach.refusal_cause("unknown")
    assert "not told" in reach.refusal_cause("")


def test_a_node_waits_for_the_superlink_saying_what_for_then_starts_or_gives_up():
    now, said = [0.0], []
    answers = iter([reach.NOT_ANSWERING] * 20 + [superlink.WAITING] * 3 + [None])

    def sleep(seconds):
        now[0] += seconds

    assert reach.wait_for_superlink("h:1", None, 600, said.append, ask=lambda: next(answers), clock=lambda: now[0],
                                    sleep=sleep)
    assert now[0] == 23.0  # asked every second until it took nodes
    assert said == [f"waiting for the SuperLink at h:1: {reach.NOT_ANSWERING}; for up to 600 s more (--wait-superlink)",
                    f"waiting for the SuperLink at h:1: {reach.NOT_ANSWERING}; for up to 585 s more (--wait-superlink)",
                    f"waiting for the SuperLink at h:1: {superlink.WAITING}; for up to 580 s more (--wait-superlink)",
                    "the SuperLink at h:1 takes nodes now (after 23 s)"]
    now[0], said[:] = 0.0, []
    assert not reach.wait_for_superlink("h:1", None, 30, said.append, ask=lambda: superlink.WAITING,
                                        clock=lambda: now[0], sleep=sleep)
    assert now[0] == 30.0 and said[-1] == (f"the SuperLink at h:1 did not take nodes within 30 s (--wait-superlink): "
                                           f"{superlink.WAITING}; giving up")


def test_nothing_listening_is_not_answering_and_a_superlink_not_fedllms_counts_as_there():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert reach.asks(f"127.0.0.1:{port}", None) == reach.NOT_ANSWERING

    class NotFound(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        assert reach.asks(f"127.0.0.1:{server.server_port}", None) is None
    finally:
        server.shutdown()


def test_the_node_keys_already_in_a_superlink_database_are_not_registered_again(tmp_path):
    """Flower's own SQL state on a file, as ``--database FILE`` keeps it: a registered key is read back (and not
    registered again at the next start); an unregistered one is registered again."""
    from flwr.superlink.config_loader import get_objectstore_linkstate_factories
    from flwr.superlink.main import get_federation_manager

    from fedllm.flower import node_keys
    from fedllm.flower.certs import write_node_keys

    write_node_keys(tmp_path / "nodes", 2)
    database = str(tmp_path / "superlink.db")
    assert node_keys.registered(database) == set() and node_keys.registered(":flwr-in-memory:") == set()
    _, factory = get_objectstore_linkstate_factories(database, get_federation_manager(is_simulation=False))
    state = factory.state()
    keys = [node_keys.key_bytes(tmp_path / "nodes" / f"client-{k}.pub") for k in range(2)]
    ids = [state.create_node("<id:none>", "none", key, 30) for key in keys]
    assert node_keys.registered(database) == set(keys)
    assert node_keys.public_bytes(tmp_path / "nodes" / "client-1.key") == keys[1]  # what a refused node asks about
    said, ran = [], []
    node_keys.register(tmp_path / "nodes", {}, "/bin/false", node_keys.registered(database), said.append)
    assert said == [f"node key client-{k}.pub registered (kept in the SuperLink's database since an earlier start)"
                    for k in range(2)]
    state.delete_node("<id:none>", ids[0])  # flwr supernode unregister
    known = node_keys.registered(database)
    assert known == {keys[1]}
    fake_flwr = tmp_path / "flwr"
    fake_flwr.write_text(f"#!{sys.executable}\nimport sys; open({str(tmp_path / 'ran')!r}, 'a').write(sys.argv[3])\n")
    fake_flwr.chmod(0o755)
    node_keys.register(tmp_path / "nodes", {}, str(fake_flwr), known, ran.append)
    assert Path(tmp_path / "ran").read_text() == str(tmp_path / "nodes" / "client-0.pub")
    assert ran == ["node key client-1.pub registered (kept in the SuperLink's database since an earlier start)",
                   "node key client-0.pub registered"]


FAKE_SUPERNODE = """
import sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n == 1:
    print("SuperNode ID: 7", flush=True)  # joined, then ended by itself (a SuperLink restart)
    sys.exit(0)
if n == 2:
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    sys.exit(1)
sys.exit(130)  # then stopped, as by Ctrl-C
"""


def test_a_node_refused_after_it_joined_says_the_cause_the_superlink_tells(tmp_path, monkeypatch, capsys):
    """After a SuperLink restart a node is refused: the message gives the cause from the key's status there (here:
    unknown, i.e. unregistered), never a guess; and every start waits for the SuperLink first."""
    from fedllm.flower import rejoin

    sleep = rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: None if s >= 1 else sleep(s))
    count, waits = tmp_path / "attempts", []
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(count)]
    rc = rejoin.serve_node(cmd, {}, tmp_path / "state", 2, superlink_ready=lambda: waits.append(1) or True,
                           refused_why=lambda: reach.refusal_cause("unknown"))
    assert rc == 130 and len(waits) == 3
    err = capsys.readouterr().err
    assert f"client 2's node left the federation: {reach.refusal_cause('unknown')}; rejoining" in err
    assert "still counts" not in err
    assert rejoin.serve_node(cmd, {}, tmp_path / "state", 2, superlink_ready=lambda: False) == 1  # gave up waiting


def test_a_restarted_superlink_stops_only_the_runs_its_predecessor_left_running():
    from datetime import UTC, datetime

    from fedllm.flower.restart import orphaned_runs

    began = datetime(2026, 12, 2, 1, 0, tzinfo=UTC)
    runs = [{"run-id": "1", "status": "running", "starting-at": "2026-12-02T00:50:00", "running-at":
             "2026-12-02T00:50:02+00:00"},  # its ServerApp died with the previous SuperLink
            {"run-id": "2", "status": "starting", "starting-at": "2026-12-02T00:59:59.5", "running-at": "N/A"},
            {"run-id": "3", "status": "running", "starting-at": "2026-12-02T01:00:01", "running-at":
             "2026-12-02T01:00:02"},  # claimed by this SuperLink's runner: alive
            {"run-id": "4", "status": "finished:completed", "starting-at": "2026-12-02T00:10:00"},
            {"run-id": "5", "status": "pending", "starting-at": "N/A"},  # this runner will start it
            {"run-id": "6", "status": "running", "starting-at": "N/A", "running-at": "N/A"}]  # unreadable: left alone
    assert orphaned_runs(runs, began) == ["1", "2"]
