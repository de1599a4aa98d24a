"""flowertune_code reads MultiPL-E at the revision the harness pins, not the hub's default branch (issue #49)
(``datasets.load_dataset`` stubbed: no network)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from fedllm.evaluation.flowertune_code_prompts import CODE_SETS
from fedllm.evaluation.tasks.flowertune_code import code_rows

RECORDS = json.loads((Path(__file__).parent.parent / "assets" / "eval" / "flowertune" / "records.json").read_text())
HARNESS_REVISION = "ff5c146da05f10bc69b9ce393b77f381b3825d1b"
"""``GeneralMultiPLE.DATASET_REVISION`` of bigcode_eval/tasks/multiple.py in yan-gao-GY/bigcode-evaluation-harness at
3ff8ee003fd8413387c0e4810dd8264957ab6414 (the fork FlowerTune's Code README installs), read from that commit."""
CTX = SimpleNamespace(data_spec=lambda key: None, limited=lambda rows: rows)


class PinnedHub:
    """``datasets.load_dataset`` of a hub holding ``rows`` at HARNESS_REVISION only; records every call."""

    def __init__(self, rows: dict):
        self.rows, self.calls = rows, []

    def __call__(self, path, name=None, **kwargs):
        import datasets

        self.calls.append((path, name, kwargs))
        if kwargs.get("revision") != HARNESS_REVISION or (path, name) not in self.rows:
            raise FileNotFoundError(f"{path} {name} {kwargs}: not in the stub")
        return datasets.Dataset.from_list(self.rows[(path, name)])


@pytest.mark.parametrize("key", ["multiple_js", "multiple_cpp"])
def test_flowertune_code_loads_multiple_at_the_harness_revision(monkeypatch, key):
    import datasets

    cs = next(c for c in CODE_SETS if c.key == key)
    rows = RECORDS[key.replace("_", "-")]
    hub = PinnedHub({("nuprl/MultiPL-E", cs.hub.name): rows})
    monkeypatch.setattr(datasets, "load_dataset", hub)
    assert code_rows(CTX, "flowertune_code", cs) == rows
    assert hub.calls == [("nuprl/MultiPL-E", f"humaneval-{key.split('_')[1]}",
                          {"split": "test", "revision": HARNESS_REVISION})]


def test_flowertune_code_warns_when_only_the_unpinned_conversion_loads(monkeypatch, caplog):
    """The pinned revision unreadable (a loading script ``datasets`` >= 4 does not run): the Parquet conversion is
    read, and a warning says its rows are the default branch's."""
    import datasets

    cs = next(c for c in CODE_SETS if c.key == "multiple_js")

    def hub(path, name=None, **kwargs):
        if kwargs.get("revision") == "refs/convert/parquet":
            return datasets.Dataset.from_list(RECORDS["multiple-js"])
        raise RuntimeError("Dataset scripts are no longer supported, but found MultiPL-E.py")

    monkeypatch.setattr(datasets, "load_dataset", hub)
    with caplog.at_level(logging.WARNING, logger="fedllm"):
        assert code_rows(CTX, "flowertune_code", cs) == RECORDS["multiple-js"]
    assert HARNESS_REVISION in caplog.text and "default branch" in caplog.text


def test_flowertune_python_sets_load_the_default_branch_as_the_harness():
    """The harness loads ``mbpp`` and ``openai_humaneval`` without a revision: fedllm does too."""
    assert {c.key: c.revision for c in CODE_SETS if c.language == "python"} == {"mbpp": "", "humaneval": ""}
