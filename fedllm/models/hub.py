"""Is a hub id loadable from here? Answered at once, so that offline runs fail fast.

With ``HF_HUB_OFFLINE=1`` (or when the hub cannot be reached at all) a model that is
not in the local Hugging Face cache cannot load; transformers would find that out only
after several requests (and, without the variable, retries with back-off). fedllm asks
the cache first and fails with its clear message.
"""

from __future__ import annotations

import os
import socket
from functools import lru_cache
from typing import Optional
from urllib.parse import urlparse

TRUE = ("1", "true", "yes", "on")


def offline() -> bool:
    """Whether the user switched the hub off (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return any(os.environ.get(v, "").strip().lower() in TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


@lru_cache(maxsize=None)
def reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub endpoint (``HF_ENDPOINT``) opens within ``timeout`` seconds."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def cached(repo_id: str, filename: str, revision: Optional[str] = None) -> bool:
    """Whether ``filename`` of hub repo ``repo_id`` is in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    except Exception:  # noqa: BLE001 — an id the hub client rejects is not cached either
        return False


def unavailable(repo_id: str, filename: str = "config.json", revision: Optional[str] = None) -> Optional[str]:
    """Why ``repo_id`` cannot be loaded from here (offline / unreachable and not cached), or None if it may."""
    if cached(repo_id, filename, revision):
        return None
    if offline():
        return "not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    if not reachable():
        return "not in the local Hugging Face cache and the hub cannot be reached from this machine"
    return None
