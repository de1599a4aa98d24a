"""How a Python program of the Code challenge is run and judged inside the sandbox: as the bigcode-evaluation-harness
runs it (``bigcode_eval/tasks/custom_metrics/execute.py``: ``check_correctness``, ``unsafe_execute``,
``reliability_guard``, ``time_limit``, ``swallow_io``; OpenAI human-eval's ``execution.py`` before it).

Run by the sandbox as ``python -c <this file's text> PROGRAM SECONDS VERDICT_FD`` (a plain script: standard
library only; it must stay readable to the sandbox's unprivileged uid, which a file in fedllm's install may not be).
It reads the program's source and deletes the file (the harness's working directory is an empty temporary
directory), then does what the harness's worker process does:

1. the guard: ``faulthandler`` off; ``exit``, ``quit`` and ``help`` set to None; ``OMP_NUM_THREADS=1``; the
   :data:`DISABLED` functions of ``os``, ``shutil`` and ``subprocess`` set to None (so ``exit(0)``, ``quit()``,
   ``os.getcwd()``, ``subprocess.Popen(...)`` raise ``TypeError``); ``ipdb``, ``joblib``, ``resource``,
   ``psutil``, ``tkinter`` made unimportable. The harness calls it without a memory limit.
2. ``exec`` of the source in an empty globals dict (so ``__name__`` is ``'builtins'``: an
   ``if __name__ == "__main__":`` block does not run), with ``sys.stdout``/``sys.stderr`` swallowed and reads of
   ``sys.stdin`` failing, under a ``SIGALRM`` timer of SECONDS (``setitimer(ITIMER_REAL)``) that raises a
   timeout exception *inside* the program (a program may catch it and go on).
3. the verdict: ``passed`` when ``exec`` returned; ``timed out`` on the timer's exception; ``failed: <e>`` on
   any other exception, ``SystemExit`` and ``KeyboardInterrupt`` included (so ``sys.exit(0)`` fails; the
   exception's type and message also go to the real stderr, which the harness does not keep). It is
   written to the file descriptor VERDICT_FD (a pipe to the sandbox's first process), never inferred from the
   exit status: a program that ends the process itself (``os._exit(0)``) writes none, which the harness, whose
   result list then stays empty, also scores ``timed out``.

The harness kills its worker one second after the timer's limit (``p.join(timeout=timeout + 1)``): the sandbox's
wall-clock limit of a Python program is SECONDS + 1 (:data:`fedllm.evaluation.code_sandbox.LANGUAGES`).
A program can forge a verdict here exactly as it can in the harness (by finding it in its own process); the
sandbox around it, not this guard, is what keeps the machine safe.
"""

import builtins
import contextlib
import faulthandler
import io
import os
import signal
import sys
import traceback

DISABLED = {
    "os": ("kill", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid", "fork", "forkpty",
           "killpg", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown", "chmod", "chown",
           "chroot", "lchflags", "lchmod", "lchown", "getcwd", "chdir"),
    "shutil": ("rmtree", "move", "chown"),
    "subprocess": ("Popen",),
}
"""What the harness's ``reliability_guard`` sets to None, by module."""
UNIMPORTABLE = ("ipdb", "joblib", "resource", "psutil", "tkinter")
"""Modules the guard replaces by None in ``sys.modules``."""


class HarnessTimeout(Exception):
    """The timer's exception (the harness's ``TimeoutException``: an ``Exception``, so ``except Exception`` catches
    it)."""


class _NoReads(io.StringIO):
    """The harness's ``WriteOnlyStringIO``: writes are kept, every read raises ``OSError``."""

    def read(self, *args, **kwargs):
        raise OSError

    def readline(self, *args, **kwargs):
        raise OSError

    def readlines(self, *args, **kwargs):
        raise OSError

    def readable(self, *args, **kwargs):
        return False


def guard() -> None:
    """The effects of the harness's ``reliability_guard()`` (called, as there, without a memory limit)."""
    faulthandler.disable()
    builtins.exit = None
    builtins.quit = None
    os.environ["OMP_NUM_THREADS"] = "1"
    import shutil
    import subprocess

    modules = {"os": os, "shutil": shutil, "subprocess": subprocess}
    for module, names in DISABLED.items():
        for name in names:
            setattr(modules[module], name, None)
    builtins.help = None
    for name in UNIMPORTABLE:
        sys.modules[name] = None


@contextlib.contextmanager
def swallowed_io():
    """stdout and stderr into a write-only buffer, stdin reads failing (the harness's ``swallow_io``)."""
    stream = _NoReads()
    previous = sys.stdout, sys.stderr, sys.stdin
    sys.stdout = sys.stderr = sys.stdin = stream
    try:
        yield
    finally:
        sys.stdout, sys.stderr, sys.stdin = previous


@contextlib.contextmanager
def timer(seconds: float):
    """Raise :class:`HarnessTimeout` in the running code after ``seconds`` of wall-clock time."""
    def expire(signum, frame):
        raise HarnessTimeout("Timed out!")

    signal.setitimer(signal.ITIMER_REAL, seconds)
    signal.signal(signal.SIGALRM, expire)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def verdict_of(source: str, seconds: float) -> str:
    """``passed``, ``timed out`` or ``failed: <e>`` of ``source`` run as the harness runs it."""
    guard()
    try:
        with swallowed_io(), timer(seconds):
            exec(source, {})  # noqa: S102  (the point: run the program as the harness does, inside the sandbox)
        return "passed"
    except HarnessTimeout:
        return "timed out"
    except BaseException as e:  # noqa: BLE001  (the harness: any exception, SystemExit included, is a failure)
        os.write(2, "".join(traceback.format_exception_only(type(e), e)).encode("utf-8", errors="replace")[:1024])
        return f"failed: {e}"


def main() -> None:
    path, seconds, verdict_fd = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
    with open(path, encoding="utf-8") as f:
        source = f.read()
    os.unlink(path)
    verdict = verdict_of(source, seconds)
    os.write(verdict_fd, verdict.encode("utf-8", errors="replace")[:4096])
    os._exit(0)  # the verdict is written: threads the program left behind do not change it


if __name__ == "__main__":
    main()
