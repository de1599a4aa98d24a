"""Where a task's examples come from: a local file, or a data set on the hub.

A *data spec* is a local file or directory (any form :func:`fedllm.data.load_records`
reads: ``.json``, ``.jsonl``, ``.csv``, ``.parquet``, a directory of ``<split>.<ext>``)
or a hub id with an optional config and split: ``openai/gsm8k:main@test``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fedllm.data.errors import DataError
from fedllm.data.loading import load_records, looks_local


class DataSourceError(DataError):
    """A task's data could not be found or read (an input error: exit code 2 on the CLI)."""


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


def read_hub(source: HubSource) -> list[dict]:
    """Records of a hub data set split (it must be in the local cache when offline)."""
    return load_records(source.path, source.name, source.split)


def read_records(spec: str, default_split: str = "test") -> list[dict]:
    """Records of a data spec: a local file or directory, else a hub id.

    Args:
        spec: local path, or ``owner/name[:config][@split]``.
        default_split: split used when a hub spec names none (and the file stem
            looked for inside a local directory).

    Raises:
        DataError: the file is missing or malformed, or the hub data set cannot be loaded.
    """
    if Path(spec).expanduser().exists() or looks_local(spec):
        return load_records(spec, None, default_split)
    return read_hub(parse_hub_spec(spec, default_split))
