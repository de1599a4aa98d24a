"""Where a task's examples come from: a local file, or a data set on the hub.

A *data spec* is either a path to a local ``.json``/``.jsonl``/``.csv``/``.tsv``/
``.parquet`` file (or a directory written by ``datasets.save_to_disk``), or a hub
id with an optional config and split: ``openai/gsm8k:main@test``.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


class DataSourceError(RuntimeError):
    """A task's data could not be found or read."""


@dataclass(frozen=True)
class HubSource:
    """A data set on the hub.

    Attributes:
        path: hub id, e.g. ``openai/gsm8k``.
        name: config name, e.g. ``main``.
        split: split to evaluate on.
    """

    path: str
    name: Optional[str] = None
    split: str = "test"

    def spec(self) -> str:
        """This source as a data spec string."""
        return self.path + (f":{self.name}" if self.name else "") + f"@{self.split}"


def parse_hub_spec(spec: str, default_split: str = "test") -> HubSource:
    """``owner/name[:config][@split]`` -> :class:`HubSource`."""
    rest, _, split = spec.partition("@")
    path, _, name = rest.partition(":")
    return HubSource(path, name or None, split or default_split)


def _read_json(path: Path) -> list[dict]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    data = json.loads(text)
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataSourceError(f"{path}: expected a list of records (or a mapping with one list)")
        data = lists[0]
    return list(data)


def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ","))


def _read_parquet(path: Path) -> list[dict]:
    import pandas as pd

    return pd.read_parquet(path).to_dict("records")


def _read_saved_dataset(path: Path) -> list[dict]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        split = "test" if "test" in ds else next(iter(ds))
        ds = ds[split]
    return [dict(r) for r in ds]


_READERS = {".json": _read_json, ".jsonl": _read_json, ".csv": _read_csv, ".tsv": _read_csv, ".parquet": _read_parquet}


def read_local(path: Path) -> list[dict]:
    """Records of a local data file or a ``save_to_disk`` directory."""
    if path.is_dir():
        return _read_saved_dataset(path)
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataSourceError(f"{path}: unsupported file type; use one of {', '.join(sorted(_READERS))}")
    return reader(path)


def read_hub(source: HubSource) -> list[dict]:
    """Records of a hub data set split (needs the data set in the local cache when offline)."""
    import datasets

    try:
        ds = datasets.load_dataset(source.path, source.name, split=source.split)
    except Exception as e:  # noqa: BLE001  (datasets raises many kinds; all mean "not available")
        raise DataSourceError(
            f"could not load hub data set {source.spec()!r} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
            "pass a local file instead"
        ) from e
    return [dict(r) for r in ds]


def read_records(spec: str, default_split: str = "test") -> list[dict]:
    """Records of a data spec: an existing local path, else a hub id.

    Args:
        spec: local file/directory, or ``owner/name[:config][@split]``.
        default_split: split used when a hub spec names none.
    """
    path = Path(spec).expanduser()
    if path.exists():
        return read_local(path)
    if path.suffix.lower() in _READERS:
        raise DataSourceError(f"data file {spec!r} does not exist")
    return read_hub(parse_hub_spec(spec, default_split))
