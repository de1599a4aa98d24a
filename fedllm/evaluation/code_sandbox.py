"""Run model-written programs in isolation and report whether each passed (exit status 0 in time).

Each program runs in its own process tree (:mod:`fedllm.evaluation.sandbox_launcher` is its first
process), started by util-linux ``unshare --net --mount --pid --fork --kill-child`` (with
``--map-root-user`` when fedllm is not root):

- **no network**: a new network namespace holds only a loopback device, which is down;
- **time**: a wall-clock limit per step (the reference harnesses' 3 s for Python, 5 s for Node, 15 s
  each to compile and to run C++), also ``RLIMIT_CPU``; on a timeout process 1 of the PID namespace
  exits and the kernel kills every process left in it (a fork bomb included);
- **memory**: ``RLIMIT_AS`` (``RLIMIT_DATA`` for Node, whose V8 reserves address space it never uses);
- **processes**: ``RLIMIT_NPROC``, counted for an unprivileged uid (``nobody`` by default) that the
  program runs as when fedllm runs as root; open files and file size are limited, no core dumps;
- **files**: the program's only writable place is a fresh scratch directory, deleted afterwards:
  ``/tmp``, ``/var/tmp`` and ``/dev/shm`` are covered by empty read-only mounts inside the sandbox, and
  the unprivileged uid cannot write anywhere else. When fedllm does not run as root the program keeps
  the user's own uid, and so the user's write permissions outside those directories (eval/README.md).

Where ``unshare`` cannot create these namespaces (not Linux, no user namespaces), nothing runs:
:func:`sandbox_problem` says why and :class:`CodeSandbox` raises :class:`SandboxUnavailable`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

LAUNCHER = Path(__file__).with_name("sandbox_launcher.py")
SANDBOX_FLAGS = ["--net", "--mount", "--pid", "--fork", "--kill-child=SIGKILL"]
OUTPUT_KEPT = 2048
"""Characters of stdout/stderr kept per program (as MultiPL-E's evaluator keeps)."""


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
        uid: the unprivileged uid/gid the program runs as when fedllm is root (65534: ``nobody``).
    """

    memory_mb: int = 2048
    processes: int = 64
    file_mb: int = 16
    open_files: int = 64
    uid: int = 65534


@dataclass(frozen=True)
class ProgramResult:
    """How one program ended.

    Attributes:
        passed: exit status 0 within the time limit.
        status: ``OK``, ``Timeout``, ``Failed`` (non-zero exit) or ``CompileError``.
        exit_code: the sandbox's exit status (124: timeout).
        stdout: the first :data:`OUTPUT_KEPT` characters of its output.
        stderr: the first :data:`OUTPUT_KEPT` characters of its error output.
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
        seconds: wall-clock limit of running it (the reference harness's).
        tool: the executable it needs (``python3``, ``node``, ``g++``).
        compile_seconds: limit of the compile step, 0 when there is none.
        memory_kind: ``address_space`` (``RLIMIT_AS``) or ``data`` (``RLIMIT_DATA``).
    """

    suffix: str
    seconds: float
    tool: str
    compile_seconds: float = 0.0
    memory_kind: str = "address_space"


LANGUAGES = {
    "python": Language(".py", 3.0, "python3"),                  # bigcode compute_code_eval(timeout=3.0)
    "javascript": Language(".js", 5.0, "node", memory_kind="data"),  # MultiPL-E eval_javascript: timeout=5
    "cpp": Language(".cpp", 15.0, "g++", compile_seconds=15.0),  # MultiPL-E eval_cpp: safe_subprocess 15 s each
}


def unshare_argv() -> list[str]:
    """``unshare`` and its flags for this user (``--map-root-user`` when not root)."""
    user = [] if os.geteuid() == 0 else ["--map-root-user"]
    return ["unshare", *user, *SANDBOX_FLAGS]


@lru_cache(maxsize=1)
def sandbox_problem() -> str:
    """Why programs cannot be isolated here (``""``: they can)."""
    if not sys.platform.startswith("linux"):
        return f"the code sandbox needs Linux namespaces; this is {sys.platform}"
    if shutil.which("unshare") is None:
        return "the code sandbox needs util-linux 'unshare' on PATH (apt-get install util-linux)"
    try:
        probe = subprocess.run([*unshare_argv(), "true"], check=False, capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"'unshare {' '.join(SANDBOX_FLAGS)}' could not run: {e}"
    if probe.returncode != 0:
        return (f"'unshare {' '.join(SANDBOX_FLAGS)}' failed ({probe.stderr.decode(errors='replace').strip()}): "
                "user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone=1) or blocked by "
                "the container")
    return ""


def tool_missing(language: str) -> str:
    """Why ``language``'s programs cannot run here (its tool is absent), or ``""``."""
    tool = LANGUAGES[language].tool
    if language == "python" or shutil.which(tool):
        return ""
    return f"{language} programs need '{tool}' on PATH (not found)"


class CodeSandbox:
    """Runs programs one at a time, each in a fresh sandbox and scratch directory.

    Args:
        limits: per-program limits.
        python: the interpreter of Python programs; None picks the first of this interpreter and
            ``python3`` on PATH that the sandbox user can execute.

    Raises:
        SandboxUnavailable: namespaces cannot be created here.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), python: str | None = None):
        problem = sandbox_problem()
        if problem:
            raise SandboxUnavailable(problem)
        self.limits = limits
        self.as_root = os.geteuid() == 0
        self.python = python or self._usable_python()

    def _usable_python(self) -> str:
        """The first interpreter a sandboxed program can start (fedllm's may sit in a directory only root reads)."""
        for candidate in dict.fromkeys([sys.executable, shutil.which("python3") or "", "/usr/bin/python3"]):
            if candidate and self._run_steps([([candidate, "-c", "pass"], 10.0, "address_space")]).passed:
                return candidate
        raise SandboxUnavailable(f"no Python interpreter runs inside the sandbox (tried {sys.executable} and "
                                 "python3 on PATH): the sandbox user cannot execute them")

    def run(self, language: str, source: str) -> ProgramResult:
        """Write ``source`` to the scratch directory, build it if needed, run it; the verdict."""
        lang = LANGUAGES[language]
        name = "program" + lang.suffix
        if language == "python":
            steps = [([self.python, name], lang.seconds, lang.memory_kind)]
        elif language == "javascript":
            steps = [(["node", name], lang.seconds, lang.memory_kind)]
        else:
            steps = [(["g++", name, "-o", "program", "-std=c++17"], lang.compile_seconds, lang.memory_kind),
                     (["./program"], lang.seconds, lang.memory_kind)]
        return self._run_steps(steps, (name, source), compiled=lang.compile_seconds > 0)

    def _run_steps(self, steps: list[tuple[list[str], float, str]], source: tuple[str, str] | None = None,
                   compiled: bool = False) -> ProgramResult:
        lim = self.limits
        scratch = Path(tempfile.mkdtemp(prefix="fedllm-sandbox-"))
        logs = Path(tempfile.mkdtemp(prefix="fedllm-sandbox-log-"))
        try:
            if source is not None:
                (scratch / source[0]).write_text(source[1], encoding="utf-8")
            if self.as_root:
                for path in [scratch, *scratch.iterdir()]:
                    os.chown(path, lim.uid, lim.uid)
            spec = {"scratch": str(scratch), "file_bytes": lim.file_mb << 20, "open_files": lim.open_files,
                    "processes": lim.processes, "uid": lim.uid if self.as_root else None, "gid": lim.uid,
                    "steps": [{"argv": argv, "seconds": seconds, "cpu_seconds": int(seconds) + 1,
                               "memory_bytes": lim.memory_mb << 20, "memory_kind": kind}
                              for argv, seconds, kind in steps]}
            total = sum(seconds for _, seconds, _ in steps) + 10.0
            with open(logs / "stdout", "wb") as out, open(logs / "stderr", "wb") as err:
                try:
                    code = subprocess.run([*unshare_argv(), sys.executable, str(LAUNCHER), json.dumps(spec)],
                                          stdin=subprocess.DEVNULL, stdout=out, stderr=err, timeout=total,
                                          check=False).returncode
                except subprocess.TimeoutExpired:  # the launcher's own limit failed: --kill-child ends the tree
                    code = 124
            stdout, stderr = (self._head(logs / n) for n in ("stdout", "stderr"))
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)
        if code == 0:
            status = "OK"
        elif code == 124:
            status = "Timeout"
        elif compiled and not stdout and "error" in stderr:
            status = "CompileError"
        else:
            status = "Failed"
        return ProgramResult(code == 0, status, code, stdout, stderr)

    @staticmethod
    def _head(path: Path) -> str:
        with open(path, "rb") as f:
            return f.read(OUTPUT_KEPT).decode("utf-8", errors="replace")
