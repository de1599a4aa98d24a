"""The one base class of errors caused by what the user gave (exit code 2 on the CLI)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable


class InputError(ValueError):
    """Bad input: a recipe key, a missing file, an impossible value. The message names what and where."""


def did_you_mean(given: object, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the closest of ``choices`` to ``given``, or ``""`` when none is close."""
    if not isinstance(given, str):
        return ""
    close = difflib.get_close_matches(given, list(choices), n=2, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        close = [lowered[given.lower()]] if given.lower() in lowered else []
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def check_local_path(given: str, what: str, hub_ok: bool = True) -> None:
    """Refuse a path that does not exist, suggesting the closest names beside it.

    Args:
        given: The argument as typed (``runs/quickstartt``).
        what: How the message names it (``RUN_DIR_OR_CHECKPOINT``).
        hub_ok: Whether ``given`` may also be a hub id; then only a path-like string is checked: one
            starting with ``.``, ``/`` or ``~``, or whose first directory exists here (``runs/...``).
            A path-like string is never taken for a hub id.

    Raises:
        InputError: ``given`` is path-like and does not exist.
    """
    path = Path(given).expanduser()
    if path.exists():
        return
    first = Path(given).parts[0] if Path(given).parts else ""
    path_like = (not hub_ok or given.startswith((".", "/", "~"))
                 or (len(Path(given).parts) > 1 and Path(first).expanduser().is_dir()))
    if not path_like:
        return
    parent = path.parent
    while not parent.is_dir() and parent != parent.parent:
        parent = parent.parent
    hint = path_hint(given) if parent == path.parent else ""
    where = f"{path.parent.resolve()} has no {path.name!r}" if parent == path.parent else \
        f"{parent.resolve()} has no {path.relative_to(parent).parts[0]!r}" if path.is_relative_to(parent) else ""
    raise InputError(f"{what} {given!r}: no such file or directory ({where}){hint}")


def path_hint(given: str) -> str:
    """``" (did you mean 'runs/quickstart'?)"`` for the names beside the missing path ``given`` closest to its
    last part, written as the user wrote the rest; ``""`` when none is close."""
    path = Path(given).expanduser()
    names = sorted(c.name for c in path.parent.iterdir()) if path.parent.is_dir() else []
    close = difflib.get_close_matches(path.name, names, n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(str(Path(given).parent / c)) for c in close)}?)" if close else ""


def install_hint(extra: str) -> str:
    """How to add fedllm's optional ``extra`` (``flower``, ``eval`` ...), for a missing-package message.

    fedllm is not on PyPI, so ``pip install "fedllm[EXTRA]"`` fails: the hint names the extra's own packages
    (read from fedllm's installed metadata) and how to reinstall fedllm with the extra, from a clone or a wheel.
    """
    from importlib import metadata

    try:
        requires = metadata.requires("fedllm") or []
    except metadata.PackageNotFoundError:
        requires = []
    packages = [r.split(";")[0].strip() for r in requires if r.replace("'", '"').endswith(f'extra == "{extra}"')]
    direct = "pip install " + " ".join(f'"{p}"' for p in packages) + ", or " if packages else ""
    return (f'{direct}reinstall fedllm with its [{extra}] extra (fedllm is not on PyPI): pip install ".[{extra}]" '
            f'in a clone of the repository, or pip install "fedllm-VERSION-py3-none-any.whl[{extra}]" from a wheel')
