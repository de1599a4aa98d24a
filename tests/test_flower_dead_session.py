"""A SuperNode restarted after a crash ends its own dead session and rejoins at once; a key fedllm's SuperLink does
not know is refused for good at once (fedllm.flower.dead_session, fedllm.flower.rejoin; no Flower process here: a
fake SuperNode. The real ``DeactivateNode`` on a real SuperLink: tests/test_flower_security.py's restarted node)."""

import json
import socket
import subprocess
import sys

import pytest

from fedllm.flower import dead_session, reach, rejoin

pytest.importorskip("flwr")


def exited_pid() -> int:
    """The pid of a process that has run and been collected (gone)."""
    proc = subprocess.Popen([sys.executable, "-S", "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_session_is_dead_only_when_its_process_is_certainly_gone(tmp_path):
    marker = tmp_path / ".node-1.activated"
    dead_session.record(marker, 42, exited_pid())
    assert json.loads(marker.read_text())["node_id"] == 42
    assert dead_session.recorded(marker).is_dead()  # its pid free (or another process's: another start time)
    dead_session.record(marker, 42, subprocess.os.getpid())
    alive = dead_session.recorded(marker)
    assert alive.started and not alive.is_dead()  # the same node started twice: its session is not ended
    alive.started = str(int(alive.started) + 1)
    assert alive.is_dead()  # the pid reused by another process
    assert dead_session.Session(42, subprocess.os.getpid(), alive.started, "another-boot", socket.gethostname()
                                ).is_dead()  # rebooted since
    assert not dead_session.Session(42, exited_pid(), "1", dead_session.boot_id(), "another-machine").is_dead()
    marker.write_text("")  # an older fedllm's marker: no record, nothing ended
    assert dead_session.recorded(marker) is None
    assert dead_session.end_if_dead(marker, "127.0.0.1:1", None, "key") == ""


def test_only_a_dead_session_the_superlink_counts_online_is_ended(tmp_path, monkeypatch):
    from fedllm.flower.certs import write_node_keys

    write_node_keys(tmp_path / "keys", 1)
    key = str(tmp_path / "keys" / "client-0.key")
    marker = tmp_path / ".node-0.activated"
    status, ended = {"now": "online"}, []
    monkeypatch.setattr(reach, "key_status", lambda address, ca, key: status["now"])
    monkeypatch.setattr(dead_session, "deactivate", lambda address, ca, key, node_id: ended.append(node_id) or "")
    dead_session.record(marker, 9, subprocess.os.getpid())  # alive: nothing ended
    assert dead_session.end_if_dead(marker, "127.0.0.1:1", None, key) == "" and ended == []
    dead_session.record(marker, 9, exited_pid())
    status["now"] = "offline"  # signed off, or timed out: nothing to end
    assert dead_session.end_if_dead(marker, "127.0.0.1:1", None, key) == "" and ended == []
    status["now"] = "online"
    assert dead_session.end_if_dead(marker, "127.0.0.1:1", None, None) == "" and ended == []  # no node key
    said = dead_session.end_if_dead(marker, "127.0.0.1:1", None, key)
    assert ended == [9] and said.startswith(reach.PREVIOUS_SESSION) and "ended that session (node 9)" in said


FAKE_SUPERNODE = """
import sys
from pathlib import Path
count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n <= int(sys.argv[2]):  # refused: the previous session still counted online, or a key the SuperLink does not know
    print("[code: 2004] Failed to activate SuperNode.", flush=True)
    sys.exit(1)
print("SuperNode ID: 7", flush=True)
sys.exit(130)  # then stopped, as by Ctrl-C
"""


def test_a_restarted_node_ends_its_dead_session_and_joins_without_waiting(tmp_path, monkeypatch, capsys):
    """Killed with every process (kill -9) and restarted: the node ends its dead session before it starts Flower's
    SuperNode, which joins at its first try instead of being refused for up to 2 x 30 s; the record then names the
    new process."""
    state = tmp_path / "state"
    state.mkdir()
    marker = state / ".node-3.activated"
    dead_session.record(marker, 7, exited_pid())
    sleep = rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: pytest.fail(f"waited {s} s") if s >= 1 else sleep(s))
    ended = []

    def end(at):
        ended.append(dead_session.recorded(at).pid)
        return "ended that session"

    record = dead_session.record

    def record_once_it_has_exited(marker, node_id, pid, *args):
        # the node has stopped (a zombie, or collected) before its joining line is read: as a busy machine may have it
        while dead_session.started_at(pid):
            sleep(0.01)
        record(marker, node_id, pid, *args)

    monkeypatch.setattr(dead_session, "record", record_once_it_has_exited)
    count = tmp_path / "attempts"
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(count), "0"]
    assert rejoin.serve_node(cmd, {}, state, 3, end_dead_session=end) == 130
    assert count.read_text() == "1" and len(ended) == 1
    assert "client 3's node: ended that session; joining now" in capsys.readouterr().err
    now = dead_session.recorded(marker)
    # the new one, exited since, with the start time read when it was started
    assert now.node_id == 7 and now.pid != ended[0] and now.started and now.is_dead()


def test_a_refused_node_whose_session_may_live_retries_as_before(tmp_path, monkeypatch):
    state = tmp_path / "state"
    state.mkdir()
    dead_session.record(state / ".node-3.activated", 7, subprocess.os.getpid())  # alive: the node started twice
    slept, sleep = [], rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: slept.append(s) if s >= 1 else sleep(s))
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(tmp_path / "attempts"), "1"]
    assert rejoin.serve_node(cmd, {}, state, 3, refused_why=lambda: reach.refusal_cause("online"),
                             end_dead_session=lambda at: dead_session.end_if_dead(at, "127.0.0.1:1", None, "k")) == 130
    assert slept == [2.0]


def test_a_key_the_superlink_does_not_know_is_refused_for_good_at_once(tmp_path, monkeypatch, capsys):
    """fedllm's SuperLink takes nodes only once its node keys are registered: a key it does not know then is not
    retried for 30 s (a SuperLink that cannot tell still is: tests/cli/test_flower_commands.py)."""
    sleep = rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: pytest.fail(f"waited {s} s") if s >= 1 else sleep(s))
    count = tmp_path / "attempts"
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(count), "99"]
    assert rejoin.serve_node(cmd, {}, tmp_path / "state", 5, refused_why=lambda: reach.refusal_cause("unknown")) == 1
    assert count.read_text() == "1"
    assert f"client 5's node: {reach.REFUSALS['unknown']}; giving up" in capsys.readouterr().err


def test_a_new_node_refused_while_its_key_has_a_session_retries_until_that_session_times_out(tmp_path, monkeypatch):
    """A node that never joined from this state directory, refused because a session of its key is online (started
    from another state directory, or stopped without signing off: it times out within 2 x 30 s), keeps retrying
    like a rejoining node (up to 150 s), not only the 30 s a key being registered gets."""
    slept, sleep = [], rejoin.time.sleep
    monkeypatch.setattr(rejoin.time, "sleep", lambda s: slept.append(s) if s >= 1 else sleep(s))
    count = tmp_path / "attempts"
    cmd = [sys.executable, "-S", "-c", FAKE_SUPERNODE, str(count), "6"]
    assert rejoin.serve_node(cmd, {}, tmp_path / "state", 2, refused_why=lambda: reach.refusal_cause("online")) == 130
    assert count.read_text() == "7" and slept == [2.0, 4.0, 8.0, 15.0, 15.0, 15.0]
