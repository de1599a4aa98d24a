"""On-disk cache of judge replies, so an interrupted judged evaluation resumes.

One JSON line per judgment: ``{"key", "model", "judgment"}``, where the key
hashes the judge model, the request parameters and the messages. Lines are
appended and flushed one at a time (a crash loses at most the line being
written; a torn last line is skipped on load). Nothing secret is stored: no API
key and no endpoint credentials, only what was asked and answered.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Optional


def judgment_key(model: str, messages: list[dict], params: dict) -> str:
    """Cache key of a judge request."""
    blob = json.dumps({"model": model, "messages": messages, "params": params}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class JudgmentCache:
    """Judge replies by request key, kept in memory and appended to a JSONL file.

    Args:
        path: the JSONL file; None caches in memory only.
    """

    def __init__(self, path: Optional[Path] = None):
        self.path = path
        self._items: dict[str, str] = {}
        self._lock = threading.Lock()
        self._torn = False
        if path is not None and path.exists():
            text = path.read_text(encoding="utf-8")
            self._torn = bool(text) and not text.endswith("\n")
            for line in text.splitlines():
                try:
                    item = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._items[item["key"]] = item["judgment"]

    def get(self, key: str) -> Optional[str]:
        """The cached reply of ``key``, or None."""
        with self._lock:
            return self._items.get(key)

    def put(self, key: str, model: str, judgment: str) -> None:
        """Remember a reply (and append it to the file)."""
        with self._lock:
            self._items[key] = judgment
            if self.path is not None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a", encoding="utf-8") as f:
                    if self._torn:
                        f.write("\n")
                        self._torn = False
                    f.write(json.dumps({"key": key, "model": model, "judgment": judgment}, ensure_ascii=False) + "\n")
                    f.flush()

    def __len__(self) -> int:
        return len(self._items)
