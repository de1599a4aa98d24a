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
