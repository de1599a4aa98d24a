"""The code sandbox of flowertune_code: hostile programs are stopped or refused, scored failed, in bounded time,
with nothing left behind (no process, no scratch directory, no file outside it); the ways out the audit of issue
#49 found are closed, whether fedllm runs as root or as an ordinary user (``nobody``, started through setpriv when
the tests run as root): a write to any world-writable directory or to one the program's uid owns, the host's
processes in ``/proc``, a secret in the environment of a process the program can see, root inside."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import sandboxkit

from fedllm.evaluation.code_sandbox import LAUNCHER, CodeSandbox

code_sandbox = sandboxkit.code_sandbox
short_python_timer = sandboxkit.short_python_timer
BOUND_S = 20.0
"""Wall-clock bound of one hostile program (its limit is 3 s, 1 s for those that loop; the machine is shared and
loaded)."""


def _program_processes() -> list[int]:
    """Processes of this checkout's sandboxes running now: a launcher, or a Python program under its harness runner
    (other checkouts' sandboxes on a shared machine are not counted)."""
    markers = (str(LAUNCHER).encode(), b"def verdict_of(")
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if any(m in cmdline for m in markers):
                pids.append(int(entry.name))
    return pids


def _scratch_dirs() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).glob("fedllm-sandbox-*")}


def _run_hostile(sandbox, source: str):
    before = _scratch_dirs()
    start = time.monotonic()
    result = sandbox.run("python", source)
    elapsed = time.monotonic() - start
    assert not result.passed and result.status != "OK"
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"
    assert _program_processes() == [], "a sandboxed process survived"
    assert _scratch_dirs() == before, "a scratch directory was left behind"
    return result, elapsed


def test_flowertune_sandbox_passes_a_correct_program_and_deletes_its_files(code_sandbox):
    before = _scratch_dirs()
    result = code_sandbox.run("python", "open('notes.txt', 'w').write('kept inside')\nassert sum([1, 2]) == 3\n")
    assert result.passed and result.status == "OK" and result.exit_code == 0
    assert _scratch_dirs() == before


def test_flowertune_sandbox_stops_an_endless_loop(code_sandbox, short_python_timer):
    result, elapsed = _run_hostile(code_sandbox, "while True:\n    pass\n")
    assert result.status == "Timeout" and elapsed >= short_python_timer


def test_flowertune_sandbox_stops_a_fork_bomb(code_sandbox, short_python_timer):
    # posix.fork: the harness's guard sets os.fork to None, the sandbox must hold without it
    source = "import posix\nwhile True:\n    try:\n        posix.fork()\n    except OSError:\n        pass\n"
    result, _ = _run_hostile(code_sandbox, source)
    assert result.status == "Timeout"


def test_flowertune_sandbox_refuses_10_gb(code_sandbox):
    result, _ = _run_hostile(code_sandbox, "block = bytearray(10 * 1024 ** 3)\nblock[-1] = 1\n")
    assert "MemoryError" in result.stderr


def test_flowertune_sandbox_refuses_writes_outside_its_directory(code_sandbox):
    name = f"fedllm-escape-{uuid.uuid4().hex}"
    targets = [Path("/tmp") / name]  # world-writable outside: an empty read-only mount inside
    if os.geteuid() == 0:  # run as nobody: a directory of the user's is not writable either
        targets.append(Path(__file__).parent / name)
    try:
        for target in targets:
            result, _ = _run_hostile(code_sandbox, f"open({str(target)!r}, 'w').write('escaped')\n")
            # refused by the read-only mount, by the permissions, or, for a directory under /tmp (a clone there),
            # because the empty mount over /tmp hides it
            refusals = ("Read-only file system", "Permission denied", "No such file or directory")
            assert not result.passed and any(r in result.stderr for r in refusals), result.stderr
            assert not target.exists()
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_flowertune_sandbox_refuses_the_network(code_sandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.setblocking(False)
        port = server.getsockname()[1]
        source = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'leak')\n"
        result, _ = _run_hostile(code_sandbox, source)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing reached the host's loopback
    assert "Connection refused" in result.stderr or "unreachable" in result.stderr


SECRET_NAME = "FEDLLM_TEST_SECRET"
PSEUDO_FILESYSTEMS = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
                      "pstore", "bpf", "configfs", "fusectl", "hugetlbfs", "binfmt_misc", "autofs", "nsfs"}
WRITES = """
import os
written = []
for directory in {targets!r}:
    try:
        with open(os.path.join(directory, {name!r}), "w") as f:
            f.write("escaped")
        written.append(directory)
    except OSError:
        pass
assert not written, written
"""
PROCESSES = """
import os
me = str(os.getpid())
seen = {p: open(f"/proc/{p}/cmdline", "rb").read() for p in os.listdir("/proc") if p.isdigit() and p != me}
assert list(seen) == ["1"] and b"sandbox_launcher.py" in seen["1"], seen
"""
ENVIRON = """
import os
leaks = []
for p in os.listdir("/proc"):
    try:
        if p.isdigit() and b"FEDLLM_TEST_SECRET" in open(f"/proc/{p}/environ", "rb").read():
            leaks.append(p)
    except OSError:
        pass
assert not leaks, leaks
try:
    open("/proc/1/environ", "rb").read()
    raise AssertionError("the launcher's environment is readable")
except PermissionError:
    pass
"""
IDENTITY = """
import ctypes, os
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
remount = ctypes.CDLL(None).mount(None, b"/", None, ctypes.c_ulong(32 | 4096), None)  # MS_REMOUNT|MS_BIND: writable
assert os.getuid() != 0 and os.geteuid() != 0, (os.getuid(), os.geteuid())
assert int(status["CapEff"], 16) == 0 and status["NoNewPrivs"].strip() == "1", status
assert remount != 0, "the program made / writable again"
assert ctypes.CDLL(None).ptrace(16, 1, None, None) != 0, "the program attached to the launcher"  # PTRACE_ATTACH
"""


def _world_writable_dirs(depth: int = 4) -> list[str]:
    """World-writable directories of this machine's real file systems, to ``depth`` levels below each mount."""
    found = set()
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point, fstype = line.split()[1].replace("\\040", " "), line.split()[2]
        if fstype in PSEUDO_FILESYSTEMS or not os.path.isdir(point):
            continue
        for root, dirs, _ in os.walk(point):
            if root.count(os.sep) - point.rstrip(os.sep).count(os.sep) >= depth:
                dirs.clear()
            dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(root, d))]
            try:
                if os.stat(root).st_mode & 0o002:
                    found.add(root)
            except OSError:
                continue
    return sorted(found | ({"/run/lock"} & {p for p in ["/run/lock"] if os.path.isdir(p)}))


@pytest.fixture(scope="module", params=["as-this-user", "as-nobody"])
def escapes(request, code_sandbox):
    """What each escape program did, fedllm running as this user or as ``nobody``, with a secret in its
    environment; the directories the write probe tried and the file name it wrote."""
    owned = Path(__file__).parent / f".fedllm-escape-dir-{uuid.uuid4().hex}"  # outside /tmp: the program's uid owns it
    name = f"fedllm-escape-{uuid.uuid4().hex}"
    targets = [*_world_writable_dirs(), str(owned)]
    programs = {"writes": ("python", WRITES.format(targets=targets, name=name)), "processes": ("python", PROCESSES),
                "environ": ("python", ENVIRON), "identity": ("python", IDENTITY)}
    secret = uuid.uuid4().hex
    owned.mkdir()
    try:
        if request.param == "as-this-user":
            if os.geteuid() == 0:
                os.chown(owned, sandboxkit.NOBODY, sandboxkit.NOBODY)
            os.environ[SECRET_NAME] = secret
            try:
                results = {k: vars(code_sandbox.run(lang, src)) for k, (lang, src) in programs.items()}
            finally:
                del os.environ[SECRET_NAME]
        else:
            python, problem = sandboxkit.nobody_python()
            if not python:
                pytest.skip(problem)
            os.chown(owned, sandboxkit.NOBODY, sandboxkit.NOBODY)
            results = sandboxkit.run_as_nobody(programs, {SECRET_NAME: secret})
        left = [t for t in targets if os.path.lexists(os.path.join(t, name))]
        yield results, targets, left
    finally:
        for target in targets:
            Path(target, name).unlink(missing_ok=True)
        shutil.rmtree(owned, ignore_errors=True)


def test_flowertune_sandbox_writes_nowhere_on_the_host(escapes):
    results, targets, left = escapes
    assert "/run/lock" in targets or not os.path.isdir("/run/lock")
    assert results["writes"]["passed"], results["writes"]["stderr"]
    assert left == [] and _program_processes() == []


def test_flowertune_sandbox_shows_only_its_own_processes(escapes):
    results, _, _ = escapes
    assert results["processes"]["passed"], results["processes"]["stderr"]


def test_flowertune_sandbox_shows_no_environment_of_fedllm(escapes):
    """No visible process's environment holds the variable planted in fedllm's; the launcher's cannot be read."""
    results, _, _ = escapes
    assert results["environ"]["passed"], results["environ"]["stderr"]


def test_flowertune_sandbox_runs_the_program_unprivileged(escapes):
    """Not uid 0, no effective capability, no new privileges; it can neither remount / nor ptrace the launcher."""
    results, _, _ = escapes
    assert results["identity"]["passed"], results["identity"]["stderr"]


def test_flowertune_sandbox_remount_path_is_read_only_too(code_sandbox, tmp_path):
    """Kernels before 5.12 (no ``mount_setattr``): each mount is remounted read-only; the same writes fail."""
    owned = Path(__file__).parent / f".fedllm-escape-dir-{uuid.uuid4().hex}"
    name = f"fedllm-escape-{uuid.uuid4().hex}"
    targets = [*_world_writable_dirs(), str(owned)]
    owned.mkdir()
    try:
        if os.geteuid() == 0:
            os.chown(owned, sandboxkit.NOBODY, sandboxkit.NOBODY)
        sandbox = CodeSandbox(python=code_sandbox.python, readonly="remount")
        result = sandbox.run("python", WRITES.format(targets=targets, name=name))
        assert result.passed, result.stderr
        assert [t for t in targets if os.path.lexists(os.path.join(t, name))] == []
    finally:
        for target in targets:
            Path(target, name).unlink(missing_ok=True)
        shutil.rmtree(owned, ignore_errors=True)
