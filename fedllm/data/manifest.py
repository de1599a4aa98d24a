"""Partition manifests: which record indices each client holds, as JSON.

A manifest is ``{"num_clients", "method", "column", ..., "clients": {"0":
{"examples": [ids], "size", "label_histogram": {label: count}}, ...}}``; record
ids index the data file as loaded (file order). Extra keys (seed, source, the
held-out ``eval`` ids) are kept as given.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Optional

from fedllm.data.errors import PartitionError
from fedllm.data.loading import USER_COLUMN

MANIFEST_NAME = "manifest.json"


def _histogram(records: list[dict], ids: list[int], column: Optional[str]) -> dict[str, int]:
    if column is None:
        return {}
    counts = Counter(str(records[i].get(column)) for i in ids)
    return dict(sorted(counts.items()))


def partition_manifest(
    parts: list[list[int]], records: list[dict], column: Optional[str] = None, method: str = "custom", **extra: Any
) -> dict:
    """Describe a partition.

    Args:
        parts: Record indices per client.
        records: The records the indices point into.
        column: Column counted in each client's ``label_histogram`` (None: the
            first of ``label``/``category`` that every record has, else no histogram).
        method: Partitioner name.
        **extra: More top-level keys (e.g. ``seed``, ``source``, ``eval``).

    Returns:
        The manifest dict (JSON-serializable).
    """
    if column is None:
        column = next((c for c in ("label", "category") if records and all(c in r for r in records)), None)
    clients = {
        str(c): {"examples": [int(i) for i in ids], "size": len(ids), "label_histogram": _histogram(records, ids, column)}
        for c, ids in enumerate(parts)
    }
    return {"num_clients": len(parts), "method": method, "column": column, **extra, "clients": clients}


def save_manifest(path: str | os.PathLike, manifest: dict) -> Path:
    """Write ``manifest`` as JSON atomically (temporary file, then rename).

    Args:
        path: Target file, or a directory to hold ``manifest.json``.
        manifest: From :func:`partition_manifest`.

    Returns:
        The written file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def manifest_clients(manifest: dict) -> list[list[int]]:
    """Record indices per client id ``0 .. num_clients - 1``.

    Raises:
        PartitionError: Client ids are not ``0 .. n-1``, a list is not integers, or a client is empty (but in a
            natural partition on ``user``: a user-keyed JSON's user without records).
    """
    clients = manifest.get("clients")
    if not isinstance(clients, dict):
        raise PartitionError("manifest has no 'clients' mapping")
    expected = [str(c) for c in range(len(clients))]
    if sorted(clients, key=lambda k: (len(k), k)) != expected:
        raise PartitionError(f"manifest client ids must be 0..{len(clients) - 1}; got {sorted(clients)}")
    if manifest.get("num_clients", len(clients)) != len(clients):
        raise PartitionError(f"manifest says num_clients={manifest['num_clients']} but lists {len(clients)} clients")
    parts = []
    for c in expected:
        ids = clients[c].get("examples") if isinstance(clients[c], dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise PartitionError(f"manifest client {c}: 'examples' must be a list of record indices")
        if not ids and (manifest.get("method"), manifest.get("column")) != ("natural", USER_COLUMN):
            raise PartitionError(f"manifest client {c} has no examples (only a natural partition on "
                                 f"{USER_COLUMN!r}, of a user-keyed JSON, has clients without records)")
        parts.append(list(ids))
    return parts


def load_manifest(path: str | os.PathLike) -> dict:
    """Read and check a manifest written by :func:`save_manifest`.

    Args:
        path: The manifest file, or the directory holding ``manifest.json``.

    Returns:
        The manifest dict.

    Raises:
        PartitionError: Missing file, invalid JSON or a malformed client list (message names the file).
    """
    path = Path(path).expanduser()
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise PartitionError(f"{path}: no partition manifest there (write one with `fedllm partition`)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PartitionError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise PartitionError(f"{path}: a manifest is a JSON object")
    try:
        manifest_clients(manifest)
    except PartitionError as e:
        raise PartitionError(f"{path}: {e}") from None
    return manifest
