"""One Ctrl-C stops README's ``pytest -n 2`` within seconds, its workers and every process their tests started with
it (tests/stop_on_interrupt.py)."""

import contextlib
import os
import signal
import subprocess
import sys
import time

from tests.cli.conftest import ROOT, clean_env

SLEEPERS = ["tests/assets/interrupt/sleepers_a.py", "tests/assets/interrupt/sleepers_b.py"]


def _gone(pid: int) -> bool:
    """Whether ``pid`` has ended (no such process, or a zombie waiting for its parent to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return any(not _gone(pid) for pid in _group_members(pgid))


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{entry}/stat") as f:
            if entry.isdigit() and int(f.read().rpartition(")")[2].split()[2]) == pgid:
                members.append(int(entry))
    return members


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_one_ctrl_c_stops_a_two_worker_run_and_every_process_its_tests_started(tmp_path):
    """Two workers, each in a test waiting on a child (one in the workers' process group, one in a session of its
    own, as Flower's processes are); the tests write a marker once their child runs, then SIGINT goes to the run's
    process group once, as a terminal's Ctrl-C does. Before the fix: exit after 14 s (pytest-xdist's 10 s wait for
    its workers) and the child in its own session still running; with the pytest-xdist of today the run without the
    hooks ends by itself in ~1.5 s, and only that child stays (the last assertion). xdist's wait is 10 minutes in this
    run (tests/assets/interrupt/patient_xdist.py): workers that did not end would hang it past the test's wait
    instead of ending it 10 s late, so the test needs no bar in seconds that a loaded machine could miss. The run
    starts with SIGINT's default action, as a terminal's foreground job has, whatever this test's own process
    inherited (a suite started in the background of a non-interactive shell ignores SIGINT, and so would the run).

    The run leaves out the repository's conftest (``--noconftest``; its session fixture imports torch in each worker:
    90 s at load 14) and takes in the same hooks it does (``-p tests.stop_on_interrupt``; the next test checks that
    conftest has them)."""
    markers = tmp_path / "markers"
    markers.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", "-p",
                            "tests.stop_on_interrupt", "-p", "tests.assets.interrupt.patient_xdist", "-n", "2",
                            *SLEEPERS], cwd=ROOT, start_new_session=True, preexec_fn=_default_sigint,
                           env=clean_env(FEDLLM_INTERRUPT_MARKERS=str(markers)), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(list(markers.iterdir())) < 2:  # both tests run, each waiting on its child
            assert run.poll() is None, run.stdout.read()
            assert time.monotonic() < deadline, "the tests never started their children"
            time.sleep(0.1)
        children = [int(p.read_text()) for p in markers.iterdir()]
        os.killpg(run.pid, signal.SIGINT)
        sent = time.monotonic()
        try:
            run.wait(timeout=300)  # stopped by the hooks: ~1 s idle; by xdist's timeout: 600 s
        finally:
            took = time.monotonic() - sent
        out = run.stdout.read()
        assert run.returncode == 2 and "KeyboardInterrupt" in out, (took, out[-2000:])
        deadline = time.monotonic() + 5  # the kernel may take a moment to tear a killed process down
        while (_group_alive(run.pid) or not all(map(_gone, children))) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _group_alive(run.pid), _group_members(run.pid)
        assert all(map(_gone, children)), [pid for pid in children if not _gone(pid)]
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()


def test_the_suites_conftest_takes_in_the_interrupt_hooks():
    """README's command runs with tests/conftest.py: the hooks the test above runs are its."""
    import tests.conftest
    import tests.stop_on_interrupt

    for hook in ("pytest_configure", "pytest_keyboard_interrupt"):
        assert getattr(tests.conftest, hook) is getattr(tests.stop_on_interrupt, hook)


TREE = """
import json, os, subprocess, sys, time
from tests.stop_on_interrupt import MARK, marked, pytest_configure, stop_marked

class Config:  # the session's process (no workerinput)
    pass

pytest_configure(Config())
run = os.environ[MARK]
script = ("import subprocess, sys, time\\n"
          "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)\\n"
          "print(g.pid, flush=True)\\n"
          "time.sleep(600)\\n")
child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
# an orphan: its parent exits at once, it a moment later; it must not stay a zombie of this session
orphan = subprocess.run([sys.executable, "-c", "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                         "'import time; time.sleep(0.5)']); print(p.pid)"], capture_output=True, text=True)
orphan_pid = int(orphan.stdout)
before = marked(run)
start = time.monotonic()
stop_marked(grace_s=2.0)
seconds = time.monotonic() - start
deadline = time.monotonic() + 30
while os.path.exists(f"/proc/{orphan_pid}") and time.monotonic() < deadline:
    time.sleep(0.1)
print(json.dumps({"child": child.pid, "grandchild": grandchild, "before": before, "after": marked(run),
                  "seconds": seconds, "orphan_gone": not os.path.exists(f"/proc/{orphan_pid}")}))
"""


def test_stopping_ends_a_whole_tree_a_child_in_its_own_session_included():
    """:func:`stop_marked`, in a process of its own: it finds its child and the grandchild in a session of its own
    (which no terminal's SIGINT reaches) by the run's mark, ends both on SIGTERM within the grace, and nothing is
    left; and an orphan a test leaves is collected by init, not kept as a zombie of the session (the subreaper of a
    first version kept them, and the Flower tests that wait for a killed SuperLink's children to go never saw them
    go)."""
    import json

    out = subprocess.run([sys.executable, "-c", TREE], capture_output=True, text=True, env=clean_env(), cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    try:
        assert {got["child"], got["grandchild"]} <= set(got["before"])
        assert got["after"] == [] and got["seconds"] < 2.0  # SIGTERM was enough: no wait for the SIGKILL
        assert got["orphan_gone"]
        assert _gone(got["grandchild"])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(got["grandchild"], signal.SIGKILL)
