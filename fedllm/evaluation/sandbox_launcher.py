"""The first process inside a code sandbox (run as a plain script by :mod:`fedllm.evaluation.code_sandbox`).

``python sandbox_launcher.py`` with the spec (JSON) on stdin, started with an empty environment by ``unshare --net
--mount --pid --fork --kill-child`` (``--map-root-user`` too when fedllm is not root), is process 1 of a fresh PID
namespace with no network (an empty network namespace) and a private mount namespace. It

1. makes itself non-dumpable (the program, even under the same real uid, can then neither read its
   ``/proc/1/environ`` or memory nor ptrace it);
2. makes every mount read-only (``mount_setattr(AT_RECURSIVE, MOUNT_ATTR_RDONLY|MOUNT_ATTR_NOSUID)``, or, on
   kernels before 5.12, a read-only bind remount of each mount in ``/proc/self/mountinfo``; a mount it cannot
   make read-only stops the sandbox), then mounts a fresh ``/proc`` that shows only this PID namespace, covers
   :data:`HIDDEN_DIRS` (``/var/tmp``, ``/dev/shm``, ``/run``) with empty read-only tmpfs mounts and ``/tmp`` with
   a private size-limited tmpfs, whose :data:`WORK` directory is the program's only writable place (its working
   directory, ``HOME`` and ``TMPDIR``) and vanishes with the namespace;
3. writes the spec's source files into :data:`WORK` and runs each step (a compiler, then the program) in a child
   that sets the resource limits (CPU seconds, address space or data size, file size, processes, open files, no
   core dumps), forbids gaining privileges (``PR_SET_NO_NEW_PRIVS``: set-uid programs do not elevate) and takes
   an unprivileged uid/gid: as root, ``setuid`` to the spec's uid (``nobody``); in a user namespace (fedllm not
   root), a nested user namespace in which the program is that uid, not root, so it has no capability over the
   mounts above (it keeps the user's real uid towards the files outside, all of them read-only);
4. kills the step and exits when a step runs past its wall-clock limit. When process 1 of a PID namespace exits,
   the kernel kills every process left in it, so nothing the program forked survives.

A step with ``verdict`` gets a pipe's write end as its last argument: its status is what it writes there
(``passed`` -> 0; ``timed out`` -> 124; ``failed: ...`` -> 1, the text on stderr; nothing -> 123), not its exit
status (:mod:`fedllm.evaluation.python_harness`).

It imports nothing from fedllm (it must start fast and depends only on the standard library).
Exit status: the last step's status; 124 on a timeout; 125 when the sandbox itself could not be set up (nothing
of the program ran); 126 when a step's executable could not be started.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import struct
import subprocess
import sys

HIDDEN_DIRS = ("/var/tmp", "/dev/shm", "/run")
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MOUNTINFO_FLAGS = {"ro": MS_RDONLY, "nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                   "noatime": 1024, "nodiratime": 2048, "relatime": 1 << 21, "strictatime": 1 << 24}
"""Per-mount options of ``/proc/self/mountinfo`` -> ``mount(2)`` flags (a remount must keep the locked ones)."""
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # 442 on every architecture's unified table
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 1, 2
CLONE_NEWUSER = 0x10000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
WORK = "/tmp/work"
"""The program's working directory, ``HOME`` and ``TMPDIR`` inside the sandbox (on the private tmpfs)."""
TIMEOUT_STATUS = 124
SETUP_FAILED_STATUS = 125
NO_VERDICT_STATUS = 123
CANNOT_EXECUTE_STATUS = 126
VERDICT_STATUS = {"passed": 0, "timed out": TIMEOUT_STATUS}
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "TMPDIR": WORK, "LANG": "C.UTF-8",
       "PYTHONDONTWRITEBYTECODE": "1"}
"""The whole environment of a step."""

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source: str | None, target: str | bytes, fstype: str | None, flags: int, data: str | None = None) -> None:
    """mount(2)."""
    enc = [x.encode() if isinstance(x, str) else x for x in (source, target, fstype, data)]
    _check(_libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {source} on {target!r}")


def mounts() -> list[tuple[bytes, int]]:
    """``(mount point, flags)`` of every mount this process sees (``/proc/self/mountinfo``)."""
    found = []
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            # mountinfo writes space, tab, newline and backslash of a mount point as octal escapes (\040)
            point = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
            flags = 0
            for option in fields[5].decode().split(","):
                flags |= MOUNTINFO_FLAGS.get(option, 0)
            found.append((point, flags))
    return found


def make_readonly(method: str = "auto") -> None:
    """Every mount read-only and set-uid-free (``auto``: one recursive ``mount_setattr``, else ``remount``)."""
    if method == "auto":
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0, 0, 0), 32)
        done = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_long(AT_FDCWD), ctypes.c_char_p(b"/"),
                             ctypes.c_long(AT_RECURSIVE), attr, ctypes.c_long(32))
        if done == 0:
            return
        if ctypes.get_errno() not in (38, 1):  # ENOSYS (kernel < 5.12), EPERM (a seccomp filter): remount instead
            _check(done, "mount_setattr / read-only")
    for point, flags in mounts():
        if os.path.exists(point):
            mount(None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | flags)


def isolate(spec: dict) -> None:
    """Steps 1 and 2 of the module docstring, then the source files in :data:`WORK` (the working directory)."""
    _check(_libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE, 0)")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    make_readonly(spec.get("readonly", "auto"))
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in HIDDEN_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=755")
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={spec['scratch_bytes']},mode=555")
    os.mkdir(WORK, 0o700)
    paths = [WORK]
    for name, text in spec.get("files", {}).items():
        paths.append(os.path.join(WORK, os.path.basename(name)))
        with open(paths[-1], "w", encoding="utf-8") as f:
            f.write(text)
    if spec["as_root"]:  # the program's uid owns them (in a user namespace, the user does already)
        for path in paths:
            os.chown(path, spec["uid"], spec["gid"])
    os.chdir(WORK)


def _write(path: str, text: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(text)


def limit_and_drop(spec: dict, step: dict):
    """The ``preexec_fn`` of a step: resource limits, no new privileges, then an unprivileged uid/gid."""
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
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
        if spec["as_root"]:  # real root: become the unprivileged uid (all capabilities go)
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        else:  # root of a user namespace: this uid becomes the unprivileged uid of a nested one
            _check(_libc.unshare(CLONE_NEWUSER), "unshare(CLONE_NEWUSER)")
            _write("/proc/self/setgroups", "deny")
            _write("/proc/self/uid_map", f"{spec['uid']} 0 1")
            _write("/proc/self/gid_map", f"{spec['gid']} 0 1")

    return apply


def run_step(spec: dict, step: dict) -> int:
    """One step's status (:data:`TIMEOUT_STATUS` when it ran past its limit)."""
    argv, pass_fds, verdict_r = list(step["argv"]), (), None
    if step.get("verdict"):
        verdict_r, verdict_w = os.pipe()
        argv.append(str(verdict_w))
        pass_fds = (verdict_w,)
    try:
        proc = subprocess.Popen(argv, env=ENV, stdin=subprocess.DEVNULL, pass_fds=pass_fds,  # cwd: WORK
                                preexec_fn=limit_and_drop(spec, step))  # noqa: PLW1509 (one thread)
    except subprocess.SubprocessError as e:  # the limits or the uid could not be set: nothing ran
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return SETUP_FAILED_STATUS
    except OSError as e:
        print(f"could not start {argv[0]}: {e}", file=sys.stderr)
        return CANNOT_EXECUTE_STATUS
    finally:
        if verdict_r is not None:
            os.close(pass_fds[0])
    try:
        status = proc.wait(timeout=step["seconds"])
    except subprocess.TimeoutExpired:
        return TIMEOUT_STATUS  # process 1 exits: the kernel kills the whole namespace
    if verdict_r is None:
        return status if status >= 0 else 128 - status
    os.set_blocking(verdict_r, False)  # a process the program left behind may still hold the write end
    try:
        verdict = os.read(verdict_r, 4096).decode("utf-8", errors="replace")
    except BlockingIOError:
        verdict = ""
    if not verdict:
        print(f"the program ended without a verdict (exit status {status}); the harness records 'timed out'",
              file=sys.stderr)
        return NO_VERDICT_STATUS
    if verdict not in VERDICT_STATUS:
        print(verdict, file=sys.stderr)
    return VERDICT_STATUS.get(verdict, 1)


def main() -> int:
    try:
        spec = json.loads(sys.stdin.read())
        isolate(spec)
    except (OSError, ValueError, KeyError) as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return SETUP_FAILED_STATUS
    status = 0
    for step in spec["steps"]:
        status = run_step(spec, step)
        if status != 0:
            return status
    return status


if __name__ == "__main__":
    sys.exit(main())
