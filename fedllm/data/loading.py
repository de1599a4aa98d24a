"""Load raw records (a list of dicts) from a local file, a directory or the hub.

Local forms: ``.json`` (a list of objects, an object holding the list under
``"data"`` or under the split name, or FedLLM-Bench's user-keyed object ``{user: [objects]}``, read with
each record's key in the column ``user``), ``.jsonl`` (one object per line), ``.csv``
and ``.parquet`` (read through ``datasets``), or a directory holding
``<split>.jsonl|json|csv|parquet``. Anything else is taken as a Hugging Face hub
id and read with ``datasets.load_dataset``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Optional

from fedllm.data.errors import DataError

log = logging.getLogger(__name__)
from fedllm.data.validation import decode_utf8

#: Suffixes that mark a path as a local file even when it does not exist.
FILE_SUFFIXES = (".json", ".jsonl", ".csv", ".tsv", ".parquet", ".arrow", ".txt", ".gz", ".zip")

LOCAL_FORMS = (
    "a .json file (a list of objects, or an object with the list under 'data' or the split name), "
    "a .jsonl, .csv or .parquet file, or a directory holding <split>.jsonl|json|csv|parquet"
)
EXPECTED_FORMS = LOCAL_FORMS + ", or a Hugging Face hub dataset id"


def _read_json(path: Path, split: str) -> list[Any]:
    try:
        obj = json.loads(decode_utf8(path.read_bytes(), str(path)))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise DataError(f"{path}: nested too deeply to read (JSON arrays/objects inside each other)") from None
    if isinstance(obj, list):
        return obj
    if isinstance(obj, dict):
        for key in ("data", split):
            if isinstance(obj.get(key), list):
                return obj[key]
        if obj and not SPLIT_NAMES & set(obj) and all(isinstance(v, list) and all(isinstance(r, dict) for r in v)
                                                       for v in obj.values()):
            return user_keyed(obj)
    raise DataError(
        f"{path}: expected a JSON list of records or an object with the list under 'data' or {split!r}; "
        f"got {type(obj).__name__}" + (f" with keys {sorted(obj)}" if isinstance(obj, dict) else "")
    )


SPLIT_NAMES = frozenset({"train", "test", "validation", "valid", "dev", "eval", "data"})
"""Keys that make a JSON object of lists split-keyed, never user-keyed."""
USER_COLUMN = "user"
"""Column that holds a record's key in a user-keyed JSON file (``federation.partition: {method: natural, column:
user}`` gives each key its own client)."""


class UserKeyedRecords(list):
    """The records of a user-keyed JSON (a list), with :attr:`users`: every key of the file in file order, those
    without records included (None when records carry their own ``user`` column, which then decides the clients)."""

    users: Optional[list[str]] = None


def user_keyed(obj: dict[str, list[dict]]) -> UserKeyedRecords:
    """FedLLM-Bench's user-keyed JSON (``{client id: [records]}``) as one list, each record tagged with its key in
    :data:`USER_COLUMN` (a record's own ``user`` column is kept), in file order (``partition: natural`` numbers
    the users in that order, as FedLLM-Bench does). An object with a key of :data:`SPLIT_NAMES` is split-keyed
    instead (``{"train": [...], "test": [...]}``).

    The list's :attr:`UserKeyedRecords.users` holds every key, a key with no records included: FedLLM-Bench's
    ``get_fed_datasets`` makes it a client with an empty data set, and so does ``partition: {method: natural, column:
    user}`` (a client with no records: sampled, it trains nothing and sends nothing, so the round aggregates the
    other sampled clients, as FedLLM-Bench's sample-count weight 0 does; a round whose sampled clients are all
    empty leaves the global state as it was, :func:`fedllm.engine.server.empty_clients`), so that client ``k`` is
    the file's ``k``-th key. Any other partition has no client for such a key (they are logged at INFO; the natural
    partition warns for each client it keeps without records).

    When records carry their own ``user`` column, that column decides the clients and :attr:`~UserKeyedRecords.users`
    is None (a key without records is then no client)."""
    users = [str(key) for key in obj]
    empty = [str(key) for key, records in obj.items() if not records]
    if empty:  # (the natural partition on 'user' warns for the clients it keeps without records)
        log.info("user-keyed JSON: %d user(s) without records (%s%s): with federation.partition {method: natural, "
                 "column: user} each is a client with no records, numbered as FedLLM-Bench numbers it (user %r is "
                 "client %d); any other partition has no client for them", len(empty),
                 ", ".join(map(repr, empty[:5])), " ..." if len(empty) > 5 else "", empty[0], users.index(empty[0]))
    rows = UserKeyedRecords({USER_COLUMN: str(key), **record} for key, records in obj.items() for record in records)
    rows.users = None if any(USER_COLUMN in r for records in obj.values() for r in records) else users
    return rows


def _read_jsonl(path: Path, split: str) -> list[Any]:
    rows = []
    for lineno, line in enumerate(decode_utf8(path.read_bytes(), str(path)).split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not a valid JSON line ({e})") from None
        except RecursionError:
            raise DataError(f"{path}:{lineno}: nested too deeply to read (JSON arrays/objects inside each "
                            "other)") from None
    return rows


def _read_with_datasets(builder: str) -> Callable[[Path, str], list[Any]]:
    def read(path: Path, split: str) -> list[Any]:
        import datasets

        if builder == "csv":
            decode_utf8(path.read_bytes(), str(path))  # name the line of a non-UTF-8 byte
        try:
            extra = {"encoding": "utf-8-sig"} if builder == "csv" else {}  # a byte-order mark is not a column name
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", **extra)
        except Exception as e:  # noqa: BLE001  (pyarrow/pandas raise many types)
            raise DataError(f"{path}: could not be read as {builder} ({type(e).__name__}: {e})") from None
        return ds.to_list()

    read.__doc__ = f"Read a {builder} file through ``datasets``."
    return read


#: Local readers by file suffix.
READERS: dict[str, Callable[[Path, str], list[Any]]] = {
    ".json": _read_json,
    ".jsonl": _read_jsonl,
    ".csv": _read_with_datasets("csv"),
    ".parquet": _read_with_datasets("parquet"),
}


def _checked(rows: list[Any], source: str) -> list[dict]:
    if not rows:
        raise DataError(f"{source}: holds no records")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"{source}: record {i + 1} is a {type(row).__name__}, expected an object (dict)")
    return rows


def _read_file(path: Path, split: str) -> list[dict]:
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected {EXPECTED_FORMS}")
    return _checked(reader(path, split), str(path))


def _read_dir(path: Path, split: str) -> list[dict]:
    candidates = [path / f"{split}{suffix}" for suffix in READERS]
    for candidate in candidates:
        if candidate.is_file():
            return _read_file(candidate, split)
    raise DataError(
        f"{path}: directory has no {split}.jsonl, {split}.json, {split}.csv or {split}.parquet "
        f"(found: {', '.join(sorted(p.name for p in path.iterdir())) or 'nothing'})"
    )


def count_local_records(path: str, split: str = "train") -> Optional[int]:
    """How many records :func:`load_records` would return for a local ``.json``/``.jsonl`` file (or a directory's
    ``<split>.json``/``.jsonl``), read without ``datasets``; None for anything else or a file it cannot read.

    A ``.jsonl`` file's records are its non-blank lines (not parsed: the loader names a bad line later).
    """
    local = Path(path).expanduser()
    if local.is_dir():  # the file the loader picks: the first of <split>.json, .jsonl, .csv, .parquet
        local = next((f for f in (local / f"{split}{suffix}" for suffix in READERS) if f.is_file()), local)
    if not local.is_file() or local.suffix.lower() not in (".json", ".jsonl"):
        return None
    try:
        if local.suffix.lower() == ".jsonl":
            with open(local, "rb") as f:
                return sum(1 for line in f if line.strip())
        return len(_read_json(local, split))
    except (OSError, DataError):
        return None


def local_sample(path: str, split: str = "train", n: int = 1000) -> Optional[list[dict]]:
    """The first ``n`` records of a local ``.json``/``.jsonl`` file (or a directory's ``<split>.json``/``.jsonl``), read
    without ``datasets``, to check their columns before anything loads; None for anything else or an unreadable
    file (the loader names its problem later)."""
    local = Path(path).expanduser()
    if local.is_dir():
        local = next((f for f in (local / f"{split}{suffix}" for suffix in READERS) if f.is_file()), local)
    if not local.is_file() or local.suffix.lower() not in (".json", ".jsonl"):
        return None
    try:
        if local.suffix.lower() == ".json":
            rows = _read_json(local, split)[:n]
        else:
            rows = []
            with open(local, "rb") as f:
                for line in f:
                    if line.strip():
                        rows.append(json.loads(decode_utf8(line, str(local))))
                        if len(rows) == n:
                            break
    except (OSError, ValueError, DataError, RecursionError):
        return None
    return rows if all(isinstance(row, dict) for row in rows) else None


def looks_local(path: str) -> bool:
    """Whether ``path`` names a local file rather than a hub id.

    A path looks local when it starts with ``./``, ``../``, ``/`` or ``~`` or ends
    in a data-file suffix (``.json``, ``.jsonl``, ``.csv``, ``.parquet``, ...).
    Hub ids such as ``openai/gsm8k`` or ``teknium/OpenHermes-2.5`` do not.

    Args:
        path: The path or id from the recipe.

    Returns:
        True for a local-looking path.
    """
    return path.startswith(("./", "../", "/", "~")) or Path(path).suffix.lower() in FILE_SUFFIXES


def _hub_offline() -> bool:
    flags = (os.environ.get(k, "").strip().lower() for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f in ("1", "true", "yes", "on") for f in flags)


def _read_hub(path: str, name: Optional[str], split: str) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(path, name, split=split)
    except Exception as e:  # noqa: BLE001  (the hub client raises many types)
        detail = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        if _hub_offline() or isinstance(e, ConnectionError):
            raise DataError(
                f"hub dataset {path!r} could not be reached offline (and it is not a local file or directory); "
                f"pass a local file instead: {LOCAL_FORMS} [{detail}]"
            ) from None
        raise DataError(
            f"could not load hub dataset {path!r} (name={name!r}, split={split!r}): {detail}; "
            f"if you meant a local file, it does not exist (expected {LOCAL_FORMS})"
        ) from None
    return _checked(ds.to_list(), f"{path} [{split}]")


def load_records(path: str, name: Optional[str] = None, split: str = "train") -> list[dict]:
    """Load a data set as a list of records.

    Args:
        path: A local ``.json``/``.jsonl``/``.csv``/``.parquet`` file, a directory
            holding ``<split>.<ext>``, or a Hugging Face hub dataset id.
        name: Hub configuration name (e.g. ``"main"`` for GSM8K); ignored locally.
        split: Split to read: the file stem inside a directory, the key of a JSON
            object, or the hub split.

    Returns:
        The records, in file order.

    Raises:
        DataError: The file is missing, malformed or empty, or the hub id cannot
            be loaded (for instance offline).
    """
    if not path:
        raise DataError(f"no data path given; expected {EXPECTED_FORMS}")
    local = Path(path).expanduser()
    if local.is_dir():
        return _read_dir(local, split)
    if local.is_file():
        return _read_file(local, split)
    if looks_local(path):
        raise DataError(f"{path}: no such file or directory; expected {LOCAL_FORMS}")
    return _read_hub(path, name, split)
