"""The checks of ``--out`` that need no model (run by the CLI before torch loads, and again by :func:`export`)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from fedllm.export.errors import ExportInputError

REPORT = "export.json"
"""Machine-readable facts of an export (ranks, errors, probe difference, command), beside README.md."""


def check_out_dir(out: Path, overwrite: bool, source: Optional[Path] = None) -> None:
    """Refuse an ``--out`` that is a file, or holds anything but an earlier export (with ``--overwrite``).

    Raises:
        ExportInputError: ``out`` is a file; is not empty and ``overwrite`` is off; or ``overwrite`` would
            delete something fedllm did not write (not an export, the working or home directory), or
            replace ``source``, the run being exported.
    """
    out = Path(out)
    if source is not None:
        given, resolved = Path(source).expanduser().resolve(), out.resolve()
        if resolved == given or resolved in given.parents:
            raise ExportInputError(f"--out {out}: would replace the run being exported ({given})")
    if out.exists() and not out.is_dir():
        raise ExportInputError(f"--out {out}: exists and is not a directory")
    if not (out.is_dir() and any(out.iterdir())):
        return
    from fedllm.runs.rundir import protected_reason

    reason = protected_reason(out, [])
    if reason is None and not ((out / REPORT).is_file() or any(out.glob(f"client-*/{REPORT}"))):
        reason = f"it is not a fedllm export (no {REPORT}) and fedllm deletes only what it created"
    if reason is not None:  # --overwrite would be refused too: no hint that leads nowhere
        already = f"--out {out}: already exists and is not empty, and" if not overwrite else \
            f"--overwrite refuses --out {out}:"
        raise ExportInputError(f"{already} {reason}; pick another --out")
    if not overwrite:
        raise ExportInputError(f"--out {out}: already exists and is not empty; pass --overwrite to replace it")
