"""One writer per directory: an advisory lock held for the whole of a run (or an export).

The lock is a file beside the directory it guards, ``<parent>/.<name>.fedllm-lock`` (beside, not
inside: ``--overwrite`` replaces the directory, and a fresh run's directory does not exist yet).
It is locked with ``flock`` (released by the kernel when the holder exits, however it exits) and
holds the holder's pid, host, start time and command, so that a refused writer can name it.
A clean exit removes the file; a file left by a killed holder is a *stale* lock: the next
writer takes it over and says whose it was. Where ``flock`` is unavailable (a file system
without locks, Windows) the pid/host in the file decide: a live pid on this host holds the
lock; a dead one is stale; another host's lock is honoured and named.

Not protected: two hosts writing one directory on a network file system without working
``flock`` (the pid of another host cannot be checked; its lock is honoured until removed by hand).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

from fedllm.common.errors import InputError

log = logging.getLogger("fedllm")

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover — Windows: pid/host only
    fcntl = None  # type: ignore[assignment]


class LockedError(InputError):
    """Another live process writes the directory (exit 2, naming the holder)."""


def lock_path(directory: str | Path) -> Path:
    """The lock file guarding ``directory`` (keyed by its resolved path, so every spelling shares it)."""
    target = Path(directory).expanduser().resolve()
    return target.parent / f".{target.name or 'root'}.fedllm-lock"


def _holder_text(info: dict) -> str:
    if not info:
        return "another process (no holder recorded)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return (f"pid {info.get('pid')} on host {info.get('host')} since {started}"
            + (f" ({info['command']})" if info.get("command") else ""))


def _read(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        info = json.loads(os.read(fd, 1 << 16).decode("utf-8", "replace") or "{}")
    except ValueError:
        return {}
    return info if isinstance(info, dict) else {}


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True


def read_holder(directory: str | Path) -> Optional[dict]:
    """The recorded holder of ``directory``'s lock file, or None when there is none."""
    path = lock_path(directory)
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _refuse(directory: Path, what: str, info: dict) -> LockedError:
    return LockedError(f"{what}={str(directory)!r} is in use by {_holder_text(info)} "
                       f"(lock file {lock_path(directory)}); wait for it to finish, stop it, or pick another {what}")


def _take_without_flock(path: Path, directory: Path, what: str) -> int:
    """The pid/host lock: exclusive create; an existing file of a dead pid on this host is stale."""
    while True:
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            info = read_holder(directory) or {}
            if info.get("host") != socket.gethostname() or _alive(info.get("pid")):
                raise _refuse(directory, what, info) from None
            log.warning("%s: stale lock of %s (not running) taken over", directory, _holder_text(info))
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@contextlib.contextmanager
def hold(directory: str | Path, what: str = "output_dir", enabled: bool = True) -> Iterator[Optional[Path]]:
    """Hold the lock of ``directory`` for the body of the ``with``; yields the lock file (None when disabled).

    Args:
        directory: The directory guarded (it need not exist yet; its parent is created).
        what: How messages name the directory (``output_dir``, ``--out``).
        enabled: False in processes that do not write (ranks other than 0).

    Raises:
        LockedError: a live process holds it; the message names its pid, host, start time and command.
    """
    if not enabled:
        yield None
        return
    directory = Path(directory)
    path = lock_path(directory)
    created = []  # parents this call creates (removed again when left empty)
    for parent in path.parents:
        if parent.exists():
            break
        created.append(parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = None
    while fd is None and fcntl is not None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            info = _read(fd)
            os.close(fd)
            raise _refuse(directory, what, info) from None
        except OSError as e:  # no locks on this file system: fall back to pid/host
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            fd = None
            break
        try:  # the file may have been removed (and re-created) by the holder that released it
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            fd = None
            continue
        stale = _read(fd)
        if stale:
            log.warning("%s: stale lock of %s (%s) taken over", directory, _holder_text(stale),
                        "still running, but no longer holding it" if _alive(stale.get("pid"))
                        and stale.get("host") == socket.gethostname() else "not running")
    if fd is None:
        fd = _take_without_flock(path, directory, what)
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": round(time.time(), 3),
            "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:])[:500]}
    from fedllm.common.redact import redact_text

    info["command"] = redact_text(info["command"])
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, json.dumps(info).encode())
    os.fsync(fd)
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # while still holding it: the next writer creates a fresh file
        os.close(fd)
        for parent in created:
            try:
                parent.rmdir()
            except OSError:
                break
