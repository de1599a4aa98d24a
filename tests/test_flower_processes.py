"""fedllm.flower.processes.Forked: the ServerApp runner's forked children (fedllm/flower/runtime.py).

- a child's exit code is its target's (an exception: 1, ``SystemExit(n)``: n), it runs in its own process group,
  and :func:`processes.stop` ends it as it ends a started command;
- after the runner's imports (``SERVER_APP_IMPORTS``: torch, transformers, peft, Flower) the runner holds one
  thread, so forking is safe; a forked child then runs torch on two threads; and it dies when the runner is
  killed with ``kill -9``.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

from flower_cluster import state

from fedllm.flower import processes


def test_forked_child_exits_with_its_targets_code_in_its_own_process_group():
    def code_7():
        return 7 if os.getpgid(0) == os.getpid() else 99

    def raises():
        raise RuntimeError("the child's own failure")

    def exits_3():
        sys.exit(3)

    assert [processes.Forked(target).wait(30) for target in (code_7, raises, exits_3)] == [7, 1, 3]


def test_stop_ends_a_forked_child_and_its_group():
    child = processes.Forked(lambda: time.sleep(600) or 0)
    assert child.poll() is None and os.getpgid(child.pid) == child.pid
    started = time.monotonic()
    processes.stop(child, grace_s=20)
    assert child.returncode == -signal.SIGTERM and time.monotonic() - started < 20


def test_after_the_server_app_imports_a_fork_runs_torch_and_dies_with_the_runner(tmp_path):
    pid_file = tmp_path / "sleeper.pid"
    runner = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import importlib, threading, time
        from fedllm.flower import processes
        from fedllm.flower.runtime import SERVER_APP_IMPORTS
        for name in SERVER_APP_IMPORTS:
            importlib.import_module(name)
        assert threading.active_count() == 1, threading.enumerate()

        def torch_on_two_threads():
            import torch
            torch.set_num_threads(2)
            a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
            return 0 if torch.allclose((a @ a.T).diagonal(), (a * a).sum(1), atol=1e-3) else 5

        assert processes.Forked(torch_on_two_threads).wait(120) == 0
        sleeper = processes.Forked(lambda: time.sleep(600) or 0)
        open({str(pid_file)!r}, "w").write(str(sleeper.pid))
        time.sleep(600)
        """)], env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not pid_file.is_file() or not pid_file.read_text():
            assert runner.poll() is None, f"the runner exited with {runner.returncode}"
            assert time.monotonic() < deadline, "no forked sleeper within 240 s"
            time.sleep(0.2)
        sleeper = int(pid_file.read_text())
        os.kill(runner.pid, signal.SIGKILL)
        runner.wait()
        deadline = time.monotonic() + 30
        while state(sleeper) not in (None, "Z"):  # running; exited (even if not yet collected) ends the wait
            assert time.monotonic() < deadline, "the forked child outlived its runner"
            time.sleep(0.1)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
            runner.wait()


def test_worker_survives_a_reply_it_cannot_hand_back(monkeypatch, tmp_path, caplog):
    """A run stopped (or a SuperNode restarted) while the worker answers a message: pushing the reply fails; the
    worker logs it and goes on to its next task instead of crashing, and drops the message's journal."""
    from flwr.app import ConfigRecord, Context, Message, RecordDict
    from flwr.supercore.task_identity import TaskIdentity
    from flwr.supernode.runtime import run_clientapp

    from fedllm.flower import client_app, runtime

    for name in ("_task_id", "_run_id", "_node_id"):  # what pulling a task sets in a worker
        monkeypatch.setattr(TaskIdentity, name, 1)
    message = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=1, message_type="train")
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})

    def refused(*_args, **_kwargs):
        raise RuntimeError("401: the task's token is no longer valid")

    monkeypatch.setattr(client_app, "app", lambda message, context: Message(RecordDict(), reply_to=message))
    monkeypatch.setattr(run_clientapp, "push_message", refused)
    monkeypatch.setattr(run_clientapp, "push_task_output", refused)
    journal = tmp_path / ".worker-0.inflight"
    journal.write_bytes(b"stale")
    with caplog.at_level("WARNING", logger="fedllm"):
        runtime.run_client_task("127.0.0.1:9", "token", runtime_cache(), journal, pulled=(message, context))
    assert "could not hand back the reply" in caplog.text and "no longer valid" in caplog.text
    assert not journal.exists()


def runtime_cache():
    from fedllm.flower.worker_cache import NodeCache

    return NodeCache()


GUARDED = """
import os, sys, time
from pathlib import Path
from fedllm.commands.flower import guard_run
from fedllm.flower import processes
marker, home = Path(sys.argv[1]), sys.argv[2]
me = os.getpid()
guard = processes.Forked(lambda: guard_run(lambda: marker.write_text("stopped"), home, me))
Path(sys.argv[3]).write_text(str(guard.pid))
if sys.argv[4] == "ends":  # the run ended: the command stops its guard, alive
    time.sleep(1)
    processes.stop(guard)
    sys.exit(0)
time.sleep(600)  # killed with kill -9 meanwhile
"""


def test_the_run_guard_stops_the_run_only_when_its_command_is_killed(tmp_path):
    """``fedllm flower run``'s guard child: ``kill -9`` of the command makes it stop the run and remove the command's
    private FLWR_HOME; a command that ends normally stops its guard, which then does nothing."""
    for how in ("ends", "kill -9"):
        marker, home, pid_file = tmp_path / f"{how}.stopped", tmp_path / f"{how}-home", tmp_path / f"{how}.pid"
        home.mkdir()
        command = subprocess.Popen([sys.executable, "-c", GUARDED, str(marker), str(home), str(pid_file), how],
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not pid_file.is_file() or not pid_file.read_text():
                assert command.poll() is None or how == "ends", f"the command exited with {command.returncode}"
                assert time.monotonic() < deadline, "no guard within 120 s"
                time.sleep(0.1)
            guard = int(pid_file.read_text())
            if how == "kill -9":
                os.kill(command.pid, signal.SIGKILL)
            command.wait(timeout=120)
            deadline = time.monotonic() + 60
            while state(guard) not in (None, "Z"):
                assert time.monotonic() < deadline, "the guard outlived its command"
                time.sleep(0.1)
            assert marker.exists() == (how == "kill -9") and home.exists() == (how == "ends")
        finally:
            if command.poll() is None:
                os.killpg(command.pid, signal.SIGKILL)
                command.wait()


SIGNS_OFF = textwrap.dedent("""
    import signal, sys, time
    from pathlib import Path
    marks = Path(sys.argv[1])
    def sign_off(sig, frame):
        (marks / "got-term").write_text(repr(time.monotonic()))
        time.sleep(1.0)  # a SuperNode telling the SuperLink it leaves
        (marks / "signed-off").write_text(repr(time.monotonic()))
        sys.exit(0)
    signal.signal(signal.SIGTERM, sign_off)
    (marks / "up").write_text("")
    while True:
        time.sleep(0.05)
""")

SUPERVISOR = textwrap.dedent("""
    import sys
    from fedllm.flower import processes
    child = [sys.executable, "-c", sys.argv[1]]
    main = lambda: processes.start([*child, sys.argv[2]])
    sys.exit(processes.supervise(main, {"worker": lambda: processes.start([*child, sys.argv[3]])}))
""")


def test_a_second_sigterm_while_the_processes_sign_off_does_not_cut_them_short(tmp_path):
    """``supervise``'s processes (a SuperNode and its worker) are stopped side by side, and a second SIGTERM (or
    Ctrl-C) during their sign-off is told and ignored: both finish signing off and the command exits 128 + 15."""
    marks = [tmp_path / "main", tmp_path / "worker"]
    for m in marks:
        m.mkdir()
    cmd = [sys.executable, "-c", SUPERVISOR, SIGNS_OFF, *map(str, marks)]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    deadline = time.monotonic() + 120
    while not all((m / "up").exists() for m in marks):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    while not all((m / "got-term").exists() for m in marks):  # both asked to sign off at once
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)  # the impatient second signal, while both are signing off
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert all((m / "signed-off").exists() for m in marks)
    got = [float((m / "got-term").read_text()) for m in marks]
    assert max(got) < min(float((m / "signed-off").read_text()) for m in marks)  # side by side
    assert proc.stderr.read().count("stopping already (SIGTERM ignored)") == 1
