"""Atomic checkpoints: safetensors for tensors, JSON for the rest, never pickle.

A checkpoint directory holds

- ``adapter.safetensors``  the global trainable state (LoRA factors, classifier head)
- ``base.safetensors``     values of the LoRA-wrapped base weights, when the strategy changes them
                           (FRLoRA, FedLoRU, FedEx-LoRA, FLoRA merges): a snapshot, shared between
                           checkpoints by a hard link, plus ``base-log-NNNN.safetensors`` (the low-rank
                           merges since it) and ``base-history.json`` (format 3; :mod:`fedllm.runs.base_history`).
                           Format 2 held the dense current values only.
- ``strategy.safetensors`` server-side strategy tensors (moments, private client states ...)
- ``clients.safetensors``  per-client state (``client<k>/<name>``: control variates, private factors,
                           optimizer moments under ``optimizer/``; see :mod:`fedllm.runs.client_store`).
                           Older checkpoints held only the moments, in ``optimizer.safetensors``.
- ``meta.json``            round, strategy, format version
- ``recipe.yaml``          the resolved recipe that produced it
- ``manifest.json``        the sha256 and size of every other file, written last

It is written under a temporary name and renamed into place, so a crash leaves
either the previous checkpoint or the new one, never a torn one. Every load checks
the manifest first, so a flipped byte or a truncated file is named (a
:class:`CheckpointError`) instead of being trained on, evaluated or exported.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from safetensors.torch import load_file, save_file

from fedllm.common.errors import InputError
from fedllm.models.state import StateDict
from fedllm.runs import base_history

if TYPE_CHECKING:
    from fedllm.runs.client_store import ClientStore

log = logging.getLogger("fedllm")

FORMAT_VERSION = 2
"""Format written: 2 carries ``manifest.json``; 1 (the first release, no manifest) is still read, unverified."""
BASE_HISTORY_VERSION = 3
"""Format of a checkpoint whose base is a snapshot plus a log (:mod:`fedllm.runs.base_history`)."""
READABLE_VERSIONS = (1, 2, 3)
META = "meta.json"
MANIFEST = "manifest.json"
_CHECKPOINT_FILES = (META, MANIFEST, "adapter.safetensors")


class CheckpointError(InputError):
    """A directory is not a complete fedllm checkpoint."""


@dataclass
class Checkpoint:
    """The contents of one checkpoint directory."""

    round: int
    adapter: StateDict
    base: StateDict = field(default_factory=dict)
    strategy: StateDict = field(default_factory=dict)
    clients: StateDict = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    recipe_yaml: str = ""
    base_history: Any = None
    """Saving: the strategy's live :class:`fedllm.runs.base_history.BaseHistory`; loading: a
    :class:`fedllm.runs.base_history.StoredHistory` (None when the base, if any, is in ``base``)."""


def _contiguous(state: StateDict) -> StateDict:
    return {k: v.detach().contiguous().cpu() for k, v in state.items()}


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path, known: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Hash every file of ``directory`` into its ``manifest.json`` (atomically, after everything else).

    ``known`` gives the entries of files hard-linked from another checkpoint: they keep the hash they were
    written with (not re-read, and damage to the shared file is still named).
    """
    directory = Path(directory)
    known = known or {}
    files = {p.name: known.get(p.name) or {"sha256": sha256_file(p), "bytes": p.stat().st_size}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}
    manifest = {"format_version": FORMAT_VERSION, "files": files}
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=1))
    return manifest


def _format_version(directory: Path) -> Any:
    try:
        meta = json.loads((directory / META).read_text())
    except (OSError, ValueError):
        return None
    return meta.get("format_version") if isinstance(meta, dict) else None


def verify_checkpoint(directory: Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest.

    Raises:
        CheckpointError: no or unreadable manifest, a listed file missing, truncated or changed;
            the message names the file.
    """
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        if _format_version(directory) == 1:
            log.warning("%s: written before checkpoints carried a manifest; its files cannot be verified", directory)
            return {}
        raise CheckpointError(f"{path}: missing; {directory} is an incomplete or damaged checkpoint")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError, OSError):
        files = None
    if not isinstance(files, dict) or META not in files or "adapter.safetensors" not in files:
        raise CheckpointError(f"{path}: unreadable or incomplete manifest; {directory} is damaged")
    for name, want in files.items():
        target = directory / name
        if not target.is_file():
            raise CheckpointError(f"{target}: missing (listed in {MANIFEST}); the checkpoint is damaged")
        size = target.stat().st_size
        if size != want.get("bytes"):
            raise CheckpointError(f"{target}: {size} bytes, the manifest says {want.get('bytes')} "
                                  "(truncated or damaged file)")
        if sha256_file(target) != want.get("sha256"):
            raise CheckpointError(f"{target}: sha256 does not match {MANIFEST} (the file is damaged)")
    return manifest


def save_checkpoint(directory: Path, ckpt: Checkpoint) -> Path:
    """Write ``ckpt`` to ``directory`` atomically (replacing an older one of the same name)."""
    directory = Path(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{directory.name}.tmp-"))
    try:
        save_file(_contiguous(ckpt.adapter), str(tmp / "adapter.safetensors"))
        for name in ("base", "strategy", "clients"):
            part = getattr(ckpt, name)
            if part:
                save_file(_contiguous(part), str(tmp / f"{name}.safetensors"))
        linked = ckpt.base_history.write(tmp) if ckpt.base_history is not None else {}
        (tmp / "recipe.yaml").write_text(ckpt.recipe_yaml)
        meta = {"format_version": FORMAT_VERSION, "round": ckpt.round, **ckpt.meta}
        if ckpt.base_history is not None:
            meta["format_version"] = BASE_HISTORY_VERSION
        (tmp / META).write_text(json.dumps(meta, indent=2))
        write_manifest(tmp, linked)
        old = None
        if directory.exists():
            old = directory.parent / f".{directory.name}.old-{os.getpid()}"
            os.replace(directory, old)
        os.replace(tmp, directory)
        if ckpt.base_history is not None:
            ckpt.base_history.committed(directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def is_checkpoint(directory: Path) -> bool:
    """True for a checkpoint directory with its meta and adapter (:func:`verify_checkpoint` checks the bytes)."""
    directory = Path(directory)
    return (directory / META).is_file() and (directory / "adapter.safetensors").is_file()


def looks_like_checkpoint(directory: Path) -> bool:
    """True when ``directory`` holds any checkpoint file: a checkpoint, possibly a damaged one."""
    directory = Path(directory)
    return directory.is_dir() and any((directory / name).exists() for name in _CHECKPOINT_FILES)


def _tensors(path: Path) -> StateDict:
    from safetensors import SafetensorError

    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: unreadable tensor file ({e})") from None


def load_checkpoint(directory: Path) -> Checkpoint:
    """Read a checkpoint after verifying it; :class:`CheckpointError` (naming the file) when it is
    missing, damaged or foreign."""
    directory = Path(directory)
    if not looks_like_checkpoint(directory):
        raise CheckpointError(f"{directory}: not a fedllm checkpoint (expected {META}, {MANIFEST} "
                              "and adapter.safetensors)")
    verify_checkpoint(directory)
    try:
        meta = json.loads((directory / META).read_text())
    except ValueError as e:
        raise CheckpointError(f"{directory / META}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") not in READABLE_VERSIONS:
        version = meta.get("format_version") if isinstance(meta, dict) else meta
        raise CheckpointError(f"{directory}: checkpoint format {version!r}, this fedllm reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    history = None
    if (directory / base_history.INDEX).is_file():
        try:
            history = base_history.StoredHistory(directory)
        except (ValueError, OSError) as e:
            raise CheckpointError(str(e)) from None
    names = ("adapter", "strategy", "clients", "optimizer") + (() if history is not None else ("base",))
    parts = {name: _tensors(directory / f"{name}.safetensors")
             if (directory / f"{name}.safetensors").is_file() else {} for name in names}
    legacy = parts.pop("optimizer")  # format of the first release: optimizer moments only
    parts["clients"].update({k.replace("/", "/optimizer/", 1): v for k, v in legacy.items()})
    recipe_path = directory / "recipe.yaml"
    return Checkpoint(round=int(meta["round"]), meta=meta, base_history=history,
                      recipe_yaml=recipe_path.read_text() if recipe_path.is_file() else "", **parts)


def client_store(ck: Checkpoint) -> ClientStore:
    """The per-client state of a checkpoint as a :class:`fedllm.runs.client_store.ClientStore`."""
    from fedllm.runs.client_store import ClientStore

    return ClientStore.from_flat(ck.clients)


def round_dir(run_dir: Path, rnd: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"round-{rnd:04d}"


def round_checkpoints(run_dir: Path) -> list[Path]:
    """The round checkpoint directories of a run, oldest first (temporaries left out, damaged ones kept)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("round-*") if p.is_dir())


def newest_intact(run_dir: Path) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """The newest round checkpoint that passes :func:`verify_checkpoint`, and the newer damaged ones.

    Returns:
        ``(checkpoint or None, [(damaged checkpoint, why), ...])``, newest first.
    """
    damaged = []
    for candidate in reversed(round_checkpoints(run_dir)):
        try:
            verify_checkpoint(candidate)
        except CheckpointError as e:
            damaged.append((candidate, str(e)))
            continue
        return candidate, damaged
    return None, damaged


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest intact round checkpoint of a run (ignores temporary leftovers and damaged ones)."""
    return newest_intact(run_dir)[0]


def prune(run_dir: Path, keep_last: Optional[int]) -> None:
    """Delete all but the newest ``keep_last`` round checkpoints, and stale temporaries."""
    root = Path(run_dir) / "checkpoints"
    for stale in root.glob(".round-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if keep_last is not None and keep_last >= 1:  # the recipe check rejects < 1; never delete the newest
        for old in sorted(p for p in root.glob("round-*") if is_checkpoint(p))[:-keep_last]:
            shutil.rmtree(old)


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a run directory (its ``final/`` or newest round) or a checkpoint.

    Never falls back silently: a damaged ``final/`` or newest round is returned as it is, so that
    loading it names the damage (eval and export stop; only ``--resume`` falls back, and says so).
    """
    path = Path(path)
    if looks_like_checkpoint(path):
        return path
    if (path / "final").is_dir():
        return path / "final"
    rounds = round_checkpoints(path)
    if rounds:
        return rounds[-1]
    raise CheckpointError(f"{path}: neither a run directory with checkpoints nor a fedllm checkpoint")


DOWNLOAD_RESIDUAL = "compression/"
ASYNC_BUFFER = "async/"  # federation.mode: async: the in-flight clients' changes (fedllm.engine.fedbuff)
"""Prefix of the server's download-compression residuals in a checkpoint's strategy state (never handed to the
strategy; :class:`fedllm.engine.compressed_rounds.Downlink`)."""


def restore_into(model: torch.nn.Module, strategy: Any, ck: Checkpoint) -> None:
    """Put a checkpoint's base weights, strategy state and global adapter into ``model``/``strategy``."""
    from fedllm.models.loading import write_state

    write_state(model, ck.base)
    strategy.load_state_dict({k: v for k, v in ck.strategy.items()
                              if not k.startswith((DOWNLOAD_RESIDUAL, ASYNC_BUFFER))})
    if ck.base_history is not None:
        base = getattr(strategy, "base", None)
        if base_history.history_of(strategy) is None:
            raise CheckpointError(f"{ck.base_history.directory}: holds a base history, which strategy "
                                  f"{getattr(strategy, 'name', strategy)!r} as configured does not keep")
        base.restore(ck.base_history)
    write_state(model, ck.adapter)
