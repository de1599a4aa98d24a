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
