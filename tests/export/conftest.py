"""Fixtures of the export tests: every strategy's tiny run and exports, reloaded once without fedllm."""

from __future__ import annotations

import contextlib

import pytest
import torch
from exportkit import CASES, build_case, card_snippet_jobs, reload_plain, write_data


@contextlib.contextmanager
def one_thread():
    """Tiny models train far faster on one thread when the machine's cores are shared; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="session")
def export_root(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="session")
def cases(export_root):
    """``{case name: Case}`` with runs, reference logits, exports and their plain reloads (one process, which
    also runs the fedavg exports' model-card snippets)."""
    with one_thread():  # the runs skip plot.png, as the suite's do (tests/conftest.py)
        data = write_data(export_root)
        built = {name: build_case(export_root, name, data) for name in CASES}
        meta = reload_plain(export_root, list(built.values()), card_snippet_jobs(built["fedavg"]))
    for case in built.values():
        case.meta = meta
    return built
