"""DPO's reference log-probabilities kept in the run directory as they are computed, so that a run interrupted
before its first checkpoint does not compute them again (:mod:`fedllm.engine.reference`).

``RUN/reference_logps.safetensors`` holds ``client<k>`` -> the client's reference table (pairs x 2, float32) of every
client done so far, written atomically at most every :data:`FLUSH_SECONDS` and when the pass ends, with the
fingerprint of what the tables depend on: the recipe's result-changing keys (those ``--resume`` compares,
:mod:`fedllm.runs.resume_check`) and every client's pair count. A file of another fingerprint is ignored (and
replaced); so is a torn or unreadable one. Once a checkpoint holds the client store (references included), resuming
reads them from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CACHE_NAME = "reference_logps.safetensors"
"""File name of the cache in the run directory."""
FLUSH_SECONDS = 30.0
"""Least time between two writes of the cache during the pass."""


def reference_fingerprint(recipe: Any, client_sizes: list[int]) -> str:
    """sha256 of the recipe's result-changing keys and the clients' pair counts."""
    from fedllm.runs.resume_check import flatten, is_safe

    keys = {k: v for k, v in flatten(recipe.to_dict()).items() if not is_safe(k)}
    text = json.dumps({"recipe": keys, "clients": client_sizes}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ReferenceCache:
    """The cache file of one run: :meth:`load` what an earlier start computed, :meth:`put` each client's table as
    it is done (written now and then), :meth:`flush` at the end.

    Args:
        path: ``RUN/reference_logps.safetensors``.
        fingerprint: :func:`reference_fingerprint` of this run.
        writer: whether this process writes the file (rank 0); every process may read it.
    """

    def __init__(self, path: Path, fingerprint: str, writer: bool = True):
        self.path, self.fingerprint, self.writer = Path(path), fingerprint, writer
        self.tables: dict[int, torch.Tensor] = {}
        self._dirty = False
        self._written = time.monotonic()

    def load(self) -> dict[int, torch.Tensor]:
        """The tables of a cache file of this fingerprint ({} when there is none, or another run's)."""
        if not self.path.is_file():
            return {}
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                if (f.metadata() or {}).get("fingerprint") != self.fingerprint:
                    log.info("%s: computed for another recipe or data; computing the references again", self.path)
                    return {}
                tables = {int(k[len("client"):]): f.get_tensor(k) for k in f.keys()}
        except Exception as e:  # noqa: BLE001  (a torn or foreign file is only a cache miss)
            log.warning("%s: unreadable (%s); computing the references again", self.path, e)
            return {}
        self.tables.update(tables)
        log.info("%s: reference log-probabilities of %d client(s) read back", self.path, len(tables))
        return dict(tables)

    def put(self, client_id: int, table: torch.Tensor) -> None:
        """Keep ``client_id``'s table; write the file when :data:`FLUSH_SECONDS` passed since the last write."""
        self.tables[int(client_id)] = table
        self._dirty = True
        if time.monotonic() - self._written >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Write every table kept so far (atomically; only the writer, only when something is new)."""
        if not (self.writer and self._dirty):
            return
        from safetensors.torch import save_file

        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        os.close(fd)
        try:
            save_file({f"client{c}": t.contiguous() for c, t in sorted(self.tables.items())}, tmp,
                      metadata={"fingerprint": self.fingerprint})
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._dirty = False
        self._written = time.monotonic()
