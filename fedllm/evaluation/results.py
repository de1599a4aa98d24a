"""Per-task result files: per-example outputs and scores, written atomically, resumable.

A task's file ``<out_dir>/<task>[.<tag>].json`` holds the task name, the
settings its outputs depend on (model fingerprint, generation limit, prompt
style, judge), the metrics, and one entry per example. Re-running with the same
settings reuses every entry whose stored prompt is unchanged, so an interrupted
evaluation resumes where it stopped; changed settings start the file afresh.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

log = logging.getLogger(__name__)


def model_fingerprint(model) -> str:
    """A cheap hash of a model's weights: names, shapes and the first values of every tensor."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.named_parameters():
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().reshape(-1)[:16].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


class ResultFile:
    """The result file of one task.

    Args:
        path: file to read and write; None keeps results in memory only.
        task: task name.
        settings: everything the outputs depend on; a stored file with other settings is ignored.
    """

    def __init__(self, path: Optional[Path], task: str, settings: dict):
        self.path = path
        self.task = task
        self.settings = settings
        self.entries: dict[str, dict] = {}
        self.metrics: dict[str, float] = {}
        if path is not None and path.exists():
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            log.warning("%s: unreadable (%s); starting afresh", path, e)
            return
        if data.get("settings") != self.settings:
            log.warning("%s: written with other settings (model, prompts or limits); starting afresh", path)
            return
        self.entries = {str(e["id"]): e for e in data.get("examples", [])}
        if self.entries:
            log.info("%s: resuming with %d stored examples", path, len(self.entries))

    def get(self, example_id: Any, **expected: Any) -> Optional[dict]:
        """The stored entry of ``example_id`` if its fields equal ``expected`` (e.g. ``prompt=...``)."""
        entry = self.entries.get(str(example_id))
        if entry is None or any(entry.get(k) != v for k, v in expected.items()):
            return None
        return entry

    def put(self, entry: dict) -> None:
        """Store (or replace) an entry; it must have an ``id``."""
        self.entries[str(entry["id"])] = entry

    def save(self, order: Optional[list[Any]] = None) -> None:
        """Write the file (entries in ``order`` of ids when given); a no-op without a path."""
        if self.path is None:
            return
        ids = [str(i) for i in order] if order is not None else list(self.entries)
        examples = [self.entries[i] for i in ids if i in self.entries]
        write_json_atomic(self.path, {"task": self.task, "settings": self.settings,
                                      "metrics": self.metrics, "examples": examples})
