"""Run model-written programs in isolation and report whether each passed, as the reference harness scores it.

Each program runs in its own process tree (:mod:`fedllm.evaluation.sandbox_launcher` is its first process),
started with an empty environment by util-linux ``unshare --net --mount --pid --fork --kill-child`` (with
``--map-root-user`` when fedllm is not root). The security model (eval/README.md, "The code sandbox"):

- **no network**: a new network namespace holds only a loopback device, which is down;
- **nothing to see**: a fresh PID namespace with its own ``/proc`` (the program sees the launcher and itself);
  the launcher is non-dumpable and has an empty environment, so no secret of fedllm's (a judge API key, an HF
  token) is in any process the program can see;
- **nothing to write**: every mount is read-only; ``/tmp`` is a private size-limited tmpfs whose ``/tmp/work``
  (the working directory) is the only writable place, gone with the namespace; ``/var/tmp``, ``/dev/shm`` and
  ``/run`` are covered by empty read-only mounts;
- **no privilege**: the program runs as an unprivileged uid (``nobody`` by default): by ``setuid`` when fedllm
  is root, as the uid of a nested user namespace otherwise (no capability over the sandbox's mounts; towards the
  files outside, the user's own uid, and they are read-only); ``PR_SET_NO_NEW_PRIVS`` (set-uid programs do not
  elevate);
- **time**: a wall-clock limit per step (the reference harnesses': Python 3 s inside the program and 4 s for the
  process, Node 5 s, 15 s each to compile and to run C++), also ``RLIMIT_CPU``; on a timeout process 1 of the
  PID namespace exits and the kernel kills every process left in it (a fork bomb included);
- **memory**: ``RLIMIT_AS`` (``RLIMIT_DATA`` for Node, whose V8 reserves address space it never uses);
- **processes**: ``RLIMIT_NPROC``; open files and file size are limited, no core dumps.

The verdict: a Python program passes as in the bigcode-evaluation-harness (:mod:`fedllm.evaluation.python_harness`:
its guard, ``exec``, its timer; ``exit(0)`` or ``sys.exit(0)`` before the tests fail); MultiPL-E's JavaScript
and C++ programs pass on exit status 0 in time, as MultiPL-E's evaluator scores them.

Where ``unshare`` cannot create these namespaces (not Linux, no user namespaces), nothing runs:
:func:`sandbox_problem` says why and :class:`CodeSandbox` raises :class:`SandboxUnavailable`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
PYTHON_HARNESS = Path(__file__).with_name("python_harness.py")
SANDBOX_FLAGS = ["--net", "--mount", "--pid", "--fork", "--kill-child=SIGKILL"]
OUTPUT_KEPT = 2048
"""Characters of stdout/stderr kept per program (as MultiPL-E's evaluator keeps)."""
VERDICT_RULES = "harness"
"""How verdicts are reached (stored beside them): a Python program as the bigcode harness judges it. Verdicts stored
without it (fedllm before issue #49 passed a Python program on exit status 0) are judged again."""
TIMEOUT_STATUS, NO_VERDICT_STATUS, SETUP_FAILED_STATUS = 124, 123, 125
"""The launcher's statuses: a step ran past its limit; a Python program ended without a verdict; no sandbox."""


class SandboxUnavailable(RuntimeError):
    """The machine cannot isolate a program (no ``unshare`` namespaces): model-written code is not run."""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one program (the defaults suit HumanEval, MBPP and MultiPL-E programs).

    Attributes:
        memory_mb: address space of the program (data size for Node), MiB.
        processes: ``RLIMIT_NPROC`` of the sandbox uid (threads count: Node starts about a dozen).
        file_mb: largest file the program may write, MiB (stdout/stderr included).
        open_files: ``RLIMIT_NOFILE``.
        scratch_mb: size of the private tmpfs holding the working directory, MiB.
        uid: the unprivileged uid/gid the program runs as (65534: ``nobody``).
    """

    memory_mb: int = 2048
    processes: int = 64
    file_mb: int = 16
    open_files: int = 64
    scratch_mb: int = 64
    uid: int = 65534


@dataclass(frozen=True)
class ProgramResult:
    """How one program ended.

    Attributes:
        passed: the harness's verdict is a pass (Python: the program and its tests ran to the end; MultiPL-E:
            exit status 0 in time).
        status: ``OK``, ``Timeout``, ``Failed`` or ``CompileError``.
        exit_code: the sandbox's exit status (124: timeout; 123: a Python program that ended the process
            before its verdict, which the harness records as ``timed out``).
        stdout: the first :data:`OUTPUT_KEPT` characters of its output (Python programs' own prints are
            swallowed, as in the harness).
        stderr: the first :data:`OUTPUT_KEPT` characters of its error output (Python: the harness's
            ``failed: <exception>``).
    """

    passed: bool
    status: str
    exit_code: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class Language:
    """How a language's program is written, built and run.

    Attributes:
        suffix: file name suffix of the source.
        seconds: wall-clock limit of running it (the reference harness's); for Python the timer inside the
            program, the process being killed ``grace_seconds`` later.
        tool: the executable it needs (``python3``, ``node``, ``g++``).
        compile_seconds: limit of the compile step, 0 when there is none.
        memory_kind: ``address_space`` (``RLIMIT_AS``) or ``data`` (``RLIMIT_DATA``).
        grace_seconds: how long after ``seconds`` the process is killed.
    """

    suffix: str
    seconds: float
    tool: str
    compile_seconds: float = 0.0
    memory_kind: str = "address_space"
    grace_seconds: float = 0.0


LANGUAGES = {
    # bigcode compute_code_eval(timeout=3.0): setitimer(3.0) in the worker, p.join(timeout=timeout + 1)
    "python": Language(".py", 3.0, "python3", grace_seconds=1.0),
    "javascript": Language(".js", 5.0, "node", memory_kind="data"),  # MultiPL-E eval_javascript: timeout=5
    "cpp": Language(".cpp", 15.0, "g++", compile_seconds=15.0),  # MultiPL-E eval_cpp: safe_subprocess 15 s each
}


def unshare_argv() -> list[str]:
    """``unshare`` (its full path: it is started with an empty environment) and its flags for this user."""
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return [shutil.which("unshare") or "unshare", *user, *SANDBOX_FLAGS]


Step = tuple[list[str], float, str, bool]
"""One step of a sandbox: ``(argv, wall-clock seconds, memory kind, whether it writes a verdict)``."""


def launcher_spec(limits: SandboxLimits, steps: list[Step], files: dict[str, str] | None = None,
                  readonly: str = "auto") -> dict:
    """What the launcher reads on stdin: the limits, the steps and the source files."""
    return {"files": files or {}, "as_root": os.geteuid() == 0, "uid": limits.uid, "gid": limits.uid,
            "readonly": readonly, "scratch_bytes": limits.scratch_mb << 20, "file_bytes": limits.file_mb << 20,
            "open_files": limits.open_files, "processes": limits.processes,
            "steps": [{"argv": argv, "seconds": seconds, "cpu_seconds": math.ceil(seconds) + 1,
                       "memory_bytes": limits.memory_mb << 20, "memory_kind": kind, "verdict": verdict}
                      for argv, seconds, kind, verdict in steps]}


def launch(spec: dict) -> tuple[int, str, str]:
    """Run :data:`LAUNCHER` on ``spec`` in fresh namespaces: its exit status and the heads of stdout and stderr."""
    total = sum(step["seconds"] for step in spec["steps"]) + 10.0
    # unlinked files: nothing of a program's output outlives this call, whatever happens to fedllm
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:  # an empty environment: the sandbox's processes hold none of fedllm's secrets
            code = subprocess.run([*unshare_argv(), sys.executable, str(LAUNCHER)], input=json.dumps(spec).encode(),
                                  stdout=out, stderr=err, timeout=total, check=False, env={}).returncode
        except subprocess.TimeoutExpired:  # the launcher's own limit failed: --kill-child ends the tree
            code = TIMEOUT_STATUS
        return code, _head(out), _head(err)


def _head(file) -> str:
    file.seek(0)
    return file.read(OUTPUT_KEPT).decode("utf-8", errors="replace")


@lru_cache(maxsize=1)
def sandbox_problem() -> str:
    """Why programs cannot be isolated here (``""``: they can): a sandbox is set up once and runs ``true``."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the code sandbox needs util-linux 'unshare' on PATH (apt-get install util-linux)"
    try:
        code, _, err = launch(launcher_spec(SandboxLimits(), [([shutil.which("true") or "/bin/true"], 10.0,
                                                                "address_space", False)]))
    except OSError as e:
        return f"'unshare {' '.join(SANDBOX_FLAGS)}' could not run: {e}"
    if code == 0:
        return ""
    if code == SETUP_FAILED_STATUS:
        return f"the sandbox could not be set up in its namespaces: {err.strip()}"
    return (f"'unshare {' '.join(SANDBOX_FLAGS)}' failed (status {code}: {err.strip()}): user namespaces may be "
            "disabled (sysctl kernel.unprivileged_userns_clone=1) or blocked by the container")


def tool_missing(language: str) -> str:
    """Why ``language``'s programs cannot run here (its tool is absent), or ``""``."""
    tool = LANGUAGES[language].tool
    if language == "python" or shutil.which(tool):
        return ""
    return f"{language} programs need '{tool}' on PATH (not found)"


class CodeSandbox:
    """Runs programs one at a time, each in a fresh sandbox.

    Args:
        limits: per-program limits.
        python: the interpreter of Python programs; None picks the first of this interpreter and
            ``python3`` on PATH that the sandbox user can execute.
        readonly: how the launcher makes the mounts read-only: ``auto`` (one recursive ``mount_setattr``,
            else a remount of each) or ``remount`` (each mount; the path of kernels before 5.12, for tests).

    Raises:
        SandboxUnavailable: namespaces cannot be created here, or the sandbox cannot be set up in them.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str | None = None, readonly: str = "auto"):
        problem = sandbox_problem()
        if problem:
            raise SandboxUnavailable(problem)
        self.limits = limits
        self.readonly = readonly
        self.python = python or self._usable_python()

    def _usable_python(self) -> str:
        """The first interpreter a sandboxed program can start (fedllm's may sit in a directory only root reads)."""
        for candidate in dict.fromkeys([sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]):
            if not candidate:
                continue
            if self._run_steps([([candidate, "-c", "pass"], 10.0, "address_space", False)]).passed:
                return candidate
        raise SandboxUnavailable(f"no Python interpreter runs inside the sandbox (tried {sys.executable} and "
                                 "python3 on PATH): the sandbox user cannot execute them")

    def run(self, language: str, source: str) -> ProgramResult:
        """Write ``source`` to the scratch directory, build it if needed, run it; the harness's verdict."""
        lang = LANGUAGES[language]
        name = "program" + lang.suffix
        if language == "python":
            harness = PYTHON_HARNESS.read_text(encoding="utf-8")
            steps = [([self.python, "-c", harness, name, str(lang.seconds)], lang.seconds + lang.grace_seconds,
                      lang.memory_kind, True)]
        elif language == "javascript":
            steps = [(["node", name], lang.seconds, lang.memory_kind, False)]
        else:
            steps = [(["g++", name, "-o", "program", "-std=c++17"], lang.compile_seconds, lang.memory_kind, False),
                     (["./program"], lang.seconds, lang.memory_kind, False)]
        return self._run_steps(steps, {name: source}, compiled=lang.compile_seconds > 0)

    def _run_steps(self, steps: list[Step], files: dict[str, str] | None = None,
                   compiled: bool = False) -> ProgramResult:
        code, stdout, stderr = launch(launcher_spec(self.limits, steps, files, self.readonly))
        if code == 0:
            status = "OK"
        elif code == TIMEOUT_STATUS:
            status = "Timeout"
        elif compiled and not stdout and "error" in stderr:
            status = "CompileError"
        else:
            status = "Failed"
        return ProgramResult(code == 0, status, code, stdout, stderr)
