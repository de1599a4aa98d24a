"""Run directories: what ``--overwrite`` may replace and where ``--resume`` continues from.

A run directory is marked by a ``.fedllm-run`` file written when the run starts. Only a
marked directory (or one of an older fedllm, holding both ``recipe.yaml`` and
``partition.json``) is ever replaced, and never the current directory, one of its
parents, the home directory, or a directory that holds the recipe or any data the
recipe reads: those are refused with a :class:`RunDirError` (exit 2) naming the path.
``--resume`` where there is no run (no directory, or an empty one) is refused too, so that
a mistyped ``output_dir`` never starts a whole new run. The checks import no torch (the CLI
runs them before the model loads).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Optional

from fedllm.common.errors import InputError
from fedllm.recipe.schema import Recipe
from fedllm.runs.resume_check import check_resume_recipe

log = logging.getLogger("fedllm")

RUN_MARKER = ".fedllm-run"
"""File that marks a directory as a fedllm run (and so as one ``--overwrite`` may replace)."""


class RunDirError(InputError):
    """The run directory cannot be used as asked (exists without --resume, not a run, protected ...)."""


def is_run_dir(path: Path) -> bool:
    """True for a directory fedllm created as a run directory."""
    path = Path(path)
    return (path / RUN_MARKER).is_file() or ((path / "recipe.yaml").is_file() and (path / "partition.json").is_file())


def mark_run_dir(path: Path) -> None:
    """Write the run marker into ``path`` (created)."""
    from fedllm.runs import checkpoint as ckpt_io

    path.mkdir(parents=True, exist_ok=True)
    ckpt_io.atomic_write_text(path / RUN_MARKER, json.dumps({"created_by": "fedllm"}) + "\n")


def recipe_inputs(recipe: Recipe) -> list[tuple[str, str]]:
    """``(what, path)`` of every local file the recipe reads."""
    found = [("the recipe", recipe.source), ("data.path", recipe.data.path), ("data.eval_path", recipe.data.eval_path),
             ("federation.partition.path", recipe.federation.partition.path)]
    found += [(f"eval.data.{task}", p) for task, p in recipe.eval.data.items()]
    return [(what, p) for what, p in found if p and Path(p).expanduser().exists()]


def protected_reason(run_dir: Path, inputs: list[tuple[str, str]]) -> Optional[str]:
    """Why ``run_dir`` must never be deleted (the cwd, a parent of it, home, or holding one of the
    ``(what, path)`` ``inputs``), or None."""
    target = Path(run_dir).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        return "it is the current directory or one of its parents"
    if target == Path.home().resolve():
        return "it is the home directory"
    for what, p in inputs:
        inside = Path(p).expanduser().resolve()
        if inside == target or target in inside.parents:
            return f"it holds {what} ({p})"
    return None


TEMPORARIES = (".final.tmp-*", ".final.old-*", "checkpoints/.round-*", ".metrics.jsonl.*", ".summary.json.*",
               ".recipe.yaml.*", ".partition.json.*", f".{RUN_MARKER}.*", ".reference_logps.safetensors.*")
"""Names of the temporaries fedllm's atomic writes leave when killed mid-write (removed on the next start)."""


def clean_temporaries(run_dir: Path) -> None:
    """Remove what an interrupted atomic write left in ``run_dir`` (only fedllm's own temporary names;
    call with the run's lock held, so that no other writer's temporary goes)."""
    for pattern in TEMPORARIES:
        for stale in Path(run_dir).glob(pattern):
            log.info("removing %s, left by an interrupted write", stale)
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
            else:
                stale.unlink(missing_ok=True)


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl``; a torn last line (a write cut off by a crash) is left out with a
    warning (the caller rewrites the file without it).

    Raises:
        InputError: a line other than the last is not a JSON object (the file is damaged); names file and line.
    """
    lines = [(i, x) for i, x in enumerate(Path(path).read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if x.strip()]
    records = []
    for n, (i, line) in enumerate(lines):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (ValueError, RecursionError) as e:
            if n == len(lines) - 1:
                log.warning("%s:%d: torn last line (%s) left out; the run continues from its checkpoint", path, i,
                            type(e).__name__)
                break
            raise InputError(f"{path}:{i}: not a JSON record ({e}); the file is damaged (only its last line may be "
                             "torn by a crash)") from None
        records.append(record)
    return records


def _start_clean(run_dir: Path, why: str, is_main: bool) -> None:
    """``--resume`` without a usable checkpoint: start at round 0, dropping the old metrics."""
    from fedllm.runs import checkpoint as ckpt_io

    log.warning("%s: %s; starting from round 0 (metrics.jsonl of the interrupted run is truncated)", run_dir, why)
    metrics = run_dir / "metrics.jsonl"
    if is_main and metrics.is_file():
        ckpt_io.atomic_write_text(metrics, "")


def check_run_dir(recipe: Recipe, resume: bool, overwrite: bool) -> None:
    """The refusals of :func:`prepare_run_dir`, without side effects (run before the model is built).

    Raises:
        RunDirError: The directory is a file, is not a fedllm run, is protected, already finished, or
            exists without ``--resume``/``--overwrite``.
    """
    run_dir = Path(recipe.output_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir={str(run_dir)!r} is a file, not a directory")
    if not (run_dir.is_dir() and any(run_dir.iterdir())):
        if resume:
            raise RunDirError(f"--resume: nothing to resume at output_dir={str(run_dir)!r} (resolved: "
                              f"{run_dir.resolve()}) — {'it is empty' if run_dir.is_dir() else 'no such directory'}; "
                              "give the output_dir of the interrupted run, or drop --resume to start a new one")
        return
    if resume:
        if not is_run_dir(run_dir):
            raise RunDirError(f"output_dir={str(run_dir)!r} is not a fedllm run directory (no {RUN_MARKER}); "
                              "nothing to resume there")
        check_resume_recipe(run_dir, recipe)
        if finished(run_dir):
            raise RunDirError(f"{run_dir}: the run already finished (final/ and summary.json exist); nothing to "
                              "resume")
        return
    if overwrite and run_dir.is_symlink():
        raise RunDirError(f"--overwrite refuses output_dir={str(run_dir)!r}: it is a symbolic link (to "
                          f"{run_dir.resolve()}); give the directory itself")
    if not overwrite and not is_run_dir(run_dir):
        raise RunDirError(f"output_dir={str(run_dir)!r} already exists, is not empty and is not a fedllm run; "
                          "pick another output_dir")
    if not overwrite:
        raise RunDirError(f"output_dir={str(run_dir)!r} already holds a run; pass --resume to continue it, "
                          "--overwrite to replace it, or output_dir=<new dir>")
    reason = protected_reason(run_dir, recipe_inputs(recipe))
    if reason is not None:
        raise RunDirError(f"--overwrite refuses output_dir={str(run_dir)!r}: {reason}; pick another output_dir")
    if not is_run_dir(run_dir):
        raise RunDirError(f"--overwrite refuses output_dir={str(run_dir)!r}: it is not a fedllm run directory "
                          f"(no {RUN_MARKER}) and fedllm deletes only what it created; pick another output_dir")


def finished(run_dir: Path) -> bool:
    """True when the run wrote an intact ``final/`` and its ``summary.json`` (a kill between the two leaves
    a run that ``--resume`` completes)."""
    return (run_dir / "summary.json").is_file() and (run_dir / "final").is_dir() and _intact(run_dir / "final")


def _intact(checkpoint: Path) -> bool:
    from fedllm.runs import checkpoint as ckpt_io

    try:
        ckpt_io.verify_checkpoint(checkpoint)
    except ckpt_io.CheckpointError as e:
        log.warning("%s", e)
        return False
    return True


def prepare_run_dir(recipe: Recipe, resume: bool, overwrite: bool, is_main: bool = True) -> Optional[Path]:
    """Check (and, with ``overwrite``, empty) the run directory; return the checkpoint to resume from.

    Args:
        recipe: The validated recipe (its ``output_dir`` and the inputs it reads).
        resume: ``--resume``: continue from the newest intact checkpoint; with none, start clean.
        overwrite: ``--overwrite``: replace an existing run.
        is_main: Whether this process writes (rank 0).

    Returns:
        The checkpoint directory to restore, or None to start at round 0.

    Raises:
        RunDirError: see :func:`check_run_dir`.
    """
    from fedllm.runs import checkpoint as ckpt_io

    if is_main:  # the other ranks of a launch may come after rank 0 began writing the run: they would see "a run"
        check_run_dir(recipe, resume, overwrite)
    run_dir = Path(recipe.output_dir)
    exists = run_dir.is_dir() and any(run_dir.iterdir())
    if resume:
        if not exists:
            log.warning("%s: no run to resume; starting from round 0", run_dir)
            return None
        if is_main:
            clean_temporaries(run_dir)
        if (run_dir / "final").is_dir() and _intact(run_dir / "final"):
            log.warning("%s: final/ was written but not summary.json (the run was stopped in between); completing "
                        "the summary and plot", run_dir)
            return run_dir / "final"
        start, damaged = ckpt_io.newest_intact(run_dir)
        for path, why in damaged:
            log.warning("skipping damaged checkpoint %s: %s", path, why)
        if start is None:
            _start_clean(run_dir, "no intact checkpoint to resume from" if damaged else "no checkpoint to resume from",
                         is_main)
        elif damaged:
            log.warning("resuming from %s, the newest intact checkpoint", start)
        return start
    if exists and is_main:  # --overwrite of a run check_run_dir allowed
        shutil.rmtree(run_dir)
    return None
