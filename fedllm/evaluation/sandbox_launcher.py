"""The first process inside a code sandbox (run as a plain script by :mod:`fedllm.evaluation.code_sandbox`).

``python sandbox_launcher.py SPEC_JSON``, started by ``unshare --net --mount --pid --fork --kill-child``, is
process 1 of a fresh PID namespace, with no network (an empty network namespace) and a private mount
namespace. It

1. covers the world-writable directories (``/tmp``, ``/var/tmp``, ``/dev/shm``) with empty read-only
   tmpfs mounts, so the only writable place left to an unprivileged user is the scratch directory,
   bind-mounted at ``/tmp/work`` (its working directory, ``HOME`` and ``TMPDIR``);
2. runs each step of the spec (a compiler, then the program) in a child that sets the resource
   limits (CPU seconds, address space or data size, file size, processes, open files, no core dumps)
   and, when the sandbox was started as root, drops to an unprivileged uid/gid first;
3. kills the step and exits when a step runs past its wall-clock limit. When process 1 of a PID
   namespace exits, the kernel kills every process left in it, so nothing the program forked survives.

It imports nothing from fedllm (it must start fast and depends only on the standard library).
Exit status: the last step's status; 124 on a timeout; 125 when the sandbox itself could not be set up.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys

HIDDEN_WRITABLE_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
MS_RDONLY, MS_REMOUNT, MS_BIND = 1, 32, 4096
WORK = "/tmp/work"
"""Where the scratch directory appears inside the sandbox (the program's working directory, HOME and TMPDIR)."""
TIMEOUT_STATUS = 124
SETUP_FAILED_STATUS = 125


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2) (the kernel resolves a relative ``source`` against the working directory, even a hidden one)."""
    libc = ctypes.CDLL(None, use_errno=True)
    enc = [x.encode() if x is not None else None for x in (source, target, fstype, data)]
    if libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


def hide_writable_dirs() -> None:
    """Mount an empty read-only tmpfs over each world-writable directory (private to this mount namespace), and
    the scratch directory (the working directory) at :data:`WORK` inside the first of them."""
    for path in HIDDEN_WRITABLE_DIRS:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", 0, "size=64k,mode=755")
            if path == os.path.dirname(WORK):
                os.mkdir(WORK)
                mount(".", WORK, None, MS_BIND)
            mount("tmpfs", path, "tmpfs", MS_REMOUNT | MS_RDONLY, "size=64k,mode=755")
    os.chdir(WORK)


def limit_and_drop(spec: dict, step: dict):
    """The ``preexec_fn`` of a step: resource limits, then (as root) the unprivileged uid/gid."""
    memory = step["memory_bytes"]

    def apply() -> None:
        os.setsid()
        limits = [(resource.RLIMIT_CPU, step["cpu_seconds"]), (resource.RLIMIT_FSIZE, spec["file_bytes"]),
                  (resource.RLIMIT_NOFILE, spec["open_files"]), (resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_NPROC, spec["processes"])]
        if memory:
            limits.append((resource.RLIMIT_AS if step["memory_kind"] == "address_space" else resource.RLIMIT_DATA,
                           memory))
        for kind, value in limits:
            resource.setrlimit(kind, (value, value))
        if spec.get("uid") is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])

    return apply


def main() -> int:
    spec = json.loads(sys.argv[1])
    try:
        os.chdir(spec["scratch"])
        hide_writable_dirs()
    except OSError as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return SETUP_FAILED_STATUS
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK,
           "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    status = 0
    for step in spec["steps"]:
        proc = subprocess.Popen(step["argv"], env=env,  # cwd: WORK
                                stdin=subprocess.DEVNULL,
                                preexec_fn=limit_and_drop(spec, step))  # noqa: PLW1509 (one thread)
        try:
            status = proc.wait(timeout=step["seconds"])
        except subprocess.TimeoutExpired:
            return TIMEOUT_STATUS  # process 1 exits: the kernel kills the whole namespace
        if status != 0:
            return status if status > 0 else 128 - status
    return status


if __name__ == "__main__":
    sys.exit(main())
