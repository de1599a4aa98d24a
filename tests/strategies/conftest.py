"""Fixtures of the strategy tests (helpers live in strategy_helpers.py)."""

import pytest
import torch
from strategy_helpers import arith_records, sentiment_records, write_jsonl


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight other processes for the cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def data_files(tmp_path_factory):
    """``{"arith": path, "sentiment": path}``: fixture data written once per session."""
    root = tmp_path_factory.mktemp("strategy-data")
    return {"arith": write_jsonl(root / "arith.jsonl", arith_records(48)),
            "sentiment": write_jsonl(root / "sentiment.jsonl", sentiment_records(40))}
