"""The code sandbox of flowertune_code: hostile programs are stopped or refused, scored failed, in bounded time,
with nothing left behind (no process, no scratch directory, no file outside it)."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import sandboxkit

code_sandbox = sandboxkit.code_sandbox
BOUND_S = 20.0
"""Wall-clock bound of one hostile program (its limit is 3 s; the machine is shared and loaded)."""


def _program_processes() -> list[int]:
    """Processes running a sandboxed program (``program.py``) now."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if b"program.py" in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                continue
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


def test_flowertune_sandbox_stops_an_endless_loop(code_sandbox):
    result, elapsed = _run_hostile(code_sandbox, "while True:\n    pass\n")
    assert result.status == "Timeout" and elapsed >= 3.0


def test_flowertune_sandbox_stops_a_fork_bomb(code_sandbox):
    source = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
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
