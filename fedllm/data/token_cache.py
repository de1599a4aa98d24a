"""A disk cache of tokenized examples, so a second run (and ``--resume``) skips tokenisation.

An entry is keyed by what decides the tokens: the sha256 of the data file(s) (or the hub id,
config and split), the tokenizer (its full serialized vocabulary, merges, normalizer and
post-processor, special tokens and chat template), the encoding options of ``data`` (format,
template, field renames, labels ...), ``train.max_length``, the label names and the source of
the encoding code itself. Inside an entry, examples are found by the sha1 of the record's JSON,
so a run that selects other records of the same file (another ``max_examples`` or seed) reuses
what it can and adds the rest.

Location: ``data.cache_dir`` when the recipe sets it, else ``$FEDLLM_CACHE_DIR``, else
``$XDG_CACHE_HOME/fedllm`` (``~/.cache/fedllm``), under ``tokenized/``; never beside the user's
data unless ``data.cache_dir`` says so. ``data.cache: false`` turns it off. Entries are ``.npz``
files written atomically; deleting the directory is always safe.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Bump when the stored layout changes.
LAYOUT = 1
#: Modules whose code decides the tokens (their source is part of the key).
ENCODING_MODULES = ("fedllm.data.formats", "fedllm.data.chat", "fedllm.data.templates", "fedllm.data.tokens",
                    "fedllm.data.preference")
#: ``data`` options that only select records (not how they are encoded): left out of the key.
SELECTION_KEYS = ("path", "name", "split", "max_examples", "eval_path", "eval_split", "eval_fraction",
                  "client_eval_fraction", "cache", "cache_dir", "on_bad_record")

Encoder = Callable[[dict], dict | None]


def default_cache_dir() -> Path:
    """``$FEDLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/fedllm``, else ``~/.cache/fedllm``."""
    if os.environ.get("FEDLLM_CACHE_DIR"):
        return Path(os.environ["FEDLLM_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "fedllm"


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes (of every file's name and bytes for a directory)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def source_fingerprint(path: str | None, name: str | None = None, split: str | None = None) -> str:
    """The data file's sha256, or for a hub data set its id, config and split."""
    if not path:
        return ""
    local = Path(path).expanduser()
    if local.exists():
        return "sha256:" + file_digest(local)
    return f"hub:{path}:{name}:{split}"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of everything of a tokenizer that decides ids (fast tokenizers: the full serialized model)."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = {"special": getattr(tokenizer, "special_tokens_map", {}), "chat": getattr(tokenizer, "chat_template", None),
             "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
             "side": getattr(tokenizer, "truncation_side", None)}
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _code_fingerprint() -> str:
    import importlib.util

    h = hashlib.sha256(str(LAYOUT).encode())
    for module in ENCODING_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()


def entry_key(data_cfg: Any, tokenizer: Any, max_length: int, label_names: list[str] | None,
              sources: list[str]) -> str:
    """The entry name: sha256 over sources, tokenizer, encoding options, max_length, labels and code."""
    import dataclasses

    options = {k: v for k, v in dataclasses.asdict(data_cfg).items() if k not in SELECTION_KEYS}
    parts = {"sources": sources, "tokenizer": tokenizer_fingerprint(tokenizer), "options": options,
             "max_length": max_length, "labels": label_names, "code": _code_fingerprint()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def record_digest(record: dict) -> bytes:
    """sha1 of a record's canonical JSON (the key of its example inside an entry)."""
    return hashlib.sha1(json.dumps(record, sort_keys=True, ensure_ascii=False, default=str).encode()).digest()


class TokenCache:
    """One cache entry: record digest -> tokenized example (or None: the encoder dropped the record).

    Args:
        path: The entry's ``.npz`` file (read if it exists, written by :meth:`save`).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.stored: dict[bytes, dict | None] = {}
        self.new: dict[bytes, dict | None] = {}
        self.hits = self.misses = 0
        if path is not None and path.is_file():
            try:
                self.stored = _read(path)
            except (OSError, ValueError, KeyError) as e:  # a damaged entry is rebuilt, never trusted
                log.warning("token cache %s unreadable (%s); tokenizing again", path, e)

    def wrap(self, encode: Encoder) -> Encoder:
        """``encode`` answered from the cache; what it computes is remembered for :meth:`save`."""

        def cached(record: dict) -> dict | None:
            key = record_digest(record)
            if key in self.stored:
                self.hits += 1
                return self.stored[key]
            if key not in self.new:
                self.misses += 1
                self.new[key] = encode(record)
            return self.new[key]

        return cached

    def save(self) -> None:
        """Write the entry with the examples computed this time (atomically; nothing when none are new)."""
        if self.path is None or not self.new:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _write(self.path, {**self.stored, **self.new})

    def info(self) -> dict[str, Any]:
        """What the cache did: entry path, records found and records tokenized."""
        return {"path": str(self.path) if self.path else None, "hits": self.hits, "tokenized": self.misses}


def open_token_cache(data_cfg: Any, tokenizer: Any, max_length: int, label_names: list[str] | None,
                     source_path: str) -> TokenCache:
    """The entry for this data, tokenizer and options (an in-memory pass-through with ``data.cache: false``)."""
    if not getattr(data_cfg, "cache", True):
        return TokenCache(None)
    sources = [source_fingerprint(source_path, data_cfg.name, data_cfg.split)]
    if data_cfg.eval_path:
        sources.append(source_fingerprint(data_cfg.eval_path, None, data_cfg.eval_split))
    root = Path(data_cfg.cache_dir).expanduser() if getattr(data_cfg, "cache_dir", None) else default_cache_dir()
    return TokenCache(root / "tokenized" / f"{entry_key(data_cfg, tokenizer, max_length, label_names, sources)}.npz")


# --------------------------------------------------------------------------- storage


def _write(path: Path, entries: dict[bytes, dict | None]) -> None:
    keys = list(entries)
    examples = [entries[k] or {} for k in keys]
    fields = sorted({f for ex in examples for f in ex})
    arrays: dict[str, np.ndarray] = {
        "digests": np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), 20),
        "kept": np.array([entries[k] is not None for k in keys], dtype=bool),
    }
    for f in fields:
        values = [ex.get(f) for ex in examples]
        if all(v is None or isinstance(v, int) for v in values):
            arrays[f"{f}.scalar"] = np.array([0 if v is None else v for v in values], dtype=np.int64)
        else:
            rows = [list(v or []) for v in values]
            arrays[f"{f}.offsets"] = np.cumsum([0] + [len(r) for r in rows], dtype=np.int64)
            arrays[f"{f}.values"] = np.array([x for r in rows for x in r], dtype=np.int64)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".npz", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _read(path: Path) -> dict[bytes, dict | None]:
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    digests, kept = arrays.pop("digests"), arrays.pop("kept")
    lists = {k[: -len(".values")]: (arrays[k].tolist(), arrays[k[: -len(".values")] + ".offsets"].tolist())
             for k in arrays if k.endswith(".values")}
    scalars = {k[: -len(".scalar")]: arrays[k].tolist() for k in arrays if k.endswith(".scalar")}
    out: dict[bytes, dict | None] = {}
    for i, key in enumerate(digests):
        if not kept[i]:
            out[key.tobytes()] = None
            continue
        ex = {f: values[off[i]:off[i + 1]] for f, (values, off) in lists.items()}
        ex.update({f: v[i] for f, v in scalars.items()})
        out[key.tobytes()] = ex
    return out
