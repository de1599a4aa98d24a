"""A node worker that finds a stale journal (its SuperNode restarted since) discards it without answering it.

A real Flower SuperNode (fedllm's entry, ``--isolation process``) serves its local Runtime API while it looks for a
SuperLink that is not there; a journal written under a task token it never issued is what a worker finds after its
SuperNode was restarted (a SuperNode keeps its tasks in memory). The kill -9 mid-message test of
``tests/test_flower_security.py`` covers the other branch: a live task's journal is answered.
"""

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

from flower_cluster import free_port, port_open, stop, wait_until

from fedllm.flower import runtime
from fedllm.flower.runtime import read_journal, replay_journal, write_journal, write_secret
from fedllm.flower.worker_cache import NodeCache


def test_worker_discards_a_stale_journal_without_answering_it(tmp_path, caplog, monkeypatch):
    from flwr.app import Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    for name in ("_task_id", "_run_id", "_node_id"):  # what pulling a task sets in a worker
        monkeypatch.setattr(TaskIdentity, name, 5)
    secret, port = write_secret(tmp_path / "secret"), free_port()
    log = tmp_path / "supernode.log"
    with open(log, "w") as out:
        node = subprocess.Popen([sys.executable, "-m", "fedllm.flower.supernode", "--superlink",
                                 f"127.0.0.1:{free_port()}", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                                 "--isolation", "process", "--superexec-auth-secret-file", str(secret),
                                 "--node-config", "partition-id=0"], stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: port_open(port), 300, "the SuperNode's Runtime API", log)  # a guard: starts in ~2 s
        journal = tmp_path / ".worker-0.inflight"
        message = Message(RecordDict(), dst_node_id=1, message_type="train")
        message.metadata.__dict__["_message_id"] = "m" * 64
        write_journal(journal, "a-token-from-before-the-restart", message,
                      Context(run_id=5, node_id=1, node_config={}, state=RecordDict(), run_config={}))
        assert read_journal(journal)[0] == "a-token-from-before-the-restart"
        cache = NodeCache()
        pauses = []  # the worker's waits for a SuperNode still starting (503 / no answer yet): none here
        monkeypatch.setattr(runtime, "time", SimpleNamespace(monotonic=time.monotonic, sleep=pauses.append))
        with caplog.at_level(logging.WARNING, logger="fedllm"):
            assert replay_journal(f"127.0.0.1:{port}", cache, journal) is False
        assert pauses == []  # refused at once (401) at the first ask, whatever the machine's load
        assert not journal.exists() and cache.built == 0 and node.poll() is None
        assert f"discarding the interrupted message {'m' * 64}: the SuperNode no longer holds its task" in caplog.text
        garbled = tmp_path / ".worker-1.inflight"
        garbled.write_bytes(b"\x05\x00")
        with caplog.at_level(logging.WARNING, logger="fedllm"):
            assert replay_journal(f"127.0.0.1:{port}", cache, garbled) is False
        assert not garbled.exists() and "unreadable" in caplog.text
    finally:
        stop(node)
