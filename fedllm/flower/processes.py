"""The processes a ``fedllm flower`` command starts: owned by it, stopped with it, never orphaned.

Every child runs in its own process group, with Linux's parent-death signal set (``PR_SET_PDEATHSIG``:
SIGTERM when the fedllm command dies, even by ``kill -9``); SIGTERM, SIGINT and SIGHUP sent to the fedllm
command are forwarded to every child's group, and a group that has not exited 10 s later is killed.
Flower's own children (``flower-superexec``, ``flwr-serverapp``) watch their parent's pid and exit with it.
Flower's executables are found beside the Python running fedllm (``sys.executable``'s directory), which is
also put first on the children's ``PATH`` (Flower starts ``flower-superexec`` by name).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fedllm.common.errors import InputError, install_hint

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
GRACE_S = 10.0
RESTART_S = 2.0  # a helper that exits is restarted, at most once per this many seconds


def tool(name: str) -> str:
    """Path of a Flower executable: beside this Python first, then on ``PATH``."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.exists() else shutil.which(name)
    if not found:
        raise InputError(f"{name}: not found beside {sys.executable} nor on PATH; install Flower: "
                         f"{install_hint('flower')}")
    return found


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with this Python's ``bin`` directory first on ``PATH``."""
    env = {**os.environ, **(extra or {})}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def _die_with_parent() -> None:  # runs in the child between fork and exec
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the signal forwarding below still applies
        pass


def start(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start ``cmd`` in its own process group, dying with this process."""
    return subprocess.Popen(cmd, env=env if env is not None else child_env(), start_new_session=True,
                            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None, **kwargs)


class Forked:
    """A child forked from this process to run ``target()`` (its return value is the exit code), in its own
    process group and dying with this process, as :func:`start`'s children do. It has the part of
    :class:`subprocess.Popen` that :func:`stop` uses (``pid``, ``poll``, ``wait``, ``returncode``).

    Forking skips the interpreter start and the imports a fresh process pays (torch, transformers and peft: about
    9 CPU-seconds). Only fork a process that has run no torch operation and holds no other thread: OpenMP's
    thread pool and threads do not survive a fork.
    """

    def __init__(self, target: Callable[[], int]):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.setpgid(0, 0)
                _die_with_parent()
                for sig in FORWARDED:  # as in a fresh Python: SIGINT raises KeyboardInterrupt, the others kill
                    signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
                code = target()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 — reported, then the child exits
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        with contextlib.suppress(OSError):  # the child did it first, or has already exited
            os.setpgid(pid, pid)  # also here, so that a stop() right after the fork finds the group
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; without ``timeout`` the caller sleeps in ``waitpid`` until the child ends (a signal handler
        that raises interrupts it)."""
        if timeout is None:
            while self.poll() is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def stop(proc: subprocess.Popen | Forked, sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> None:
    """Send ``sig`` to ``proc``'s process group; kill the group if it has not exited after ``grace_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=grace_s)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def stop_all(procs: list, sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> None:
    """:func:`stop` every process of ``procs`` at once: ``sig`` to every group, then up to ``grace_s`` for all of them
    together (a SuperNode and its worker sign off side by side, not one after the other); the groups still running
    then are killed."""
    live = [proc for proc in procs if proc.poll() is None]
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
    deadline = time.monotonic() + grace_s
    for proc in live:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class AlreadyStopping:
    """The signal handler while a command's processes sign off: a second Ctrl-C or SIGTERM is told, once, that the
    command is stopping (its processes are killed after :data:`GRACE_S` at most), and does not cut the sign-off short
    (before, it ended the command there: a SuperNode that had not signed off stayed online on the SuperLink for two
    heartbeats, 60 s, and its restart was refused meanwhile)."""

    def __init__(self) -> None:
        self.told = False

    def __call__(self, sig: int, _frame) -> None:
        if not self.told:
            self.told = True
            print(f"fedllm: stopping already ({signal.Signals(sig).name} ignored): each process has up to "
                  f"{GRACE_S:.0f} s to sign off, then it is killed", file=sys.stderr, flush=True)


class Stopped(Exception):
    """A forwarded signal ended the command."""

    def __init__(self, sig: int):
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def supervise(main: Callable[[], subprocess.Popen], helpers: dict[str, Callable[[], subprocess.Popen]] | None = None,
              on_stop: Callable[[], None] | None = None, after_start: Callable[[subprocess.Popen], None] | None = None,
              poll_s: float = 0.2, kept: dict[str, subprocess.Popen] | None = None) -> int:
    """Run ``main()``'s process (and ``helpers``, restarted whenever they exit) until ``main`` exits.

    ``after_start(main process)`` runs once everything is started; ``on_stop()`` when a signal stops it. Returns
    ``main``'s exit code, or ``128 + signal`` when a forwarded signal stopped everything. Every process started here is
    stopped before returning, except, with ``kept``, the helpers when ``main`` exited by itself: they stay running in
    ``kept`` (name -> process), where the next call finds them instead of starting them again, and the caller stops
    them in the end (:func:`stop_all`).
    """
    procs: dict[str, subprocess.Popen] = {}
    started: dict[str, float] = {}
    kept_on_exit = False
    previous = {}

    def forward(sig: int, _frame) -> None:
        raise Stopped(sig)

    for sig in FORWARDED:
        previous[sig] = signal.signal(sig, forward)
    try:
        procs["main"] = main()
        for name, make in (helpers or {}).items():
            running = (kept or {}).get(name)
            if running is not None and running.poll() is None:
                procs[name], started[name] = running, -float("inf")
            else:
                procs[name], started[name] = make(), time.monotonic()
        if after_start is not None:
            after_start(procs["main"])
        while procs["main"].poll() is None:
            for name, make in (helpers or {}).items():
                if procs[name].poll() is not None and time.monotonic() - started[name] >= RESTART_S:
                    print(f"fedllm: {name} exited with code {procs[name].returncode}; restarting it",
                          file=sys.stderr, flush=True)
                    procs[name], started[name] = make(), time.monotonic()
            time.sleep(poll_s)
        kept_on_exit = kept is not None
        return int(procs["main"].returncode)
    except Stopped as stopped:
        if on_stop is not None:
            on_stop()
        return 128 + stopped.sig
    finally:
        stopping = AlreadyStopping()
        for sig in previous:
            signal.signal(sig, stopping)
        try:
            if kept_on_exit:
                kept.update({name: proc for name, proc in procs.items() if name != "main"})
                procs = {"main": procs["main"]}
            stop_all(list(reversed(procs.values())))
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


PRIVATE_PREFIX = "fedllm-superlink-"
PRIVATE_FILES = {"superexec.secret", "owner.pid", "nonces", "ready"}
"""What ``fedllm flower superlink`` keeps in its private temporary directory (and nothing else)."""


def started_at(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``), None when it does not run: with the
    pid it tells a process from a later one that got the same pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_line(pid: int | None = None) -> str:
    """What ``owner.pid`` holds: the pid of the command and when it started."""
    pid = os.getpid() if pid is None else pid
    return f"{pid} {started_at(pid) or ''}".strip() + "\n"


def owner_alive(line: str) -> bool:
    """Whether the process :func:`owner_line` wrote ``line`` for still runs (the same process, not a new one with its
    pid)."""
    pid, *start = line.split()
    now = started_at(int(pid))
    return now is not None and (not start or start[0] == now)


def remove_stale_private_dirs(root: Path | None = None) -> list[Path]:
    """Delete the private directories of earlier ``fedllm flower superlink`` commands that were killed (``kill -9``
    leaves them, with a stale secret): only ours (prefix, owner, nothing but :data:`PRIVATE_FILES`) whose command
    is gone. Returns what was deleted."""
    import shutil
    import tempfile

    removed = []
    for path in Path(root or tempfile.gettempdir()).glob(PRIVATE_PREFIX + "*"):
        try:
            if not path.is_dir() or path.is_symlink() or path.stat().st_uid != os.getuid():
                continue
            names = {p.name for p in path.iterdir()}
            alive = owner_alive((path / "owner.pid").read_text())
        except (OSError, ValueError):
            continue  # not one of ours, or still being written
        if names <= PRIVATE_FILES and not alive:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
