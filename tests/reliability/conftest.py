"""Fixtures of the fault-injection tests: one finished tiny run with a checkpoint after every round."""

from __future__ import annotations

import shutil

import pytest

from tests.conftest import arith_records, write_jsonl


def tiny_raw(tmp, data, **sections):
    """A raw recipe of a tiny LLaMA on ``data`` (3 rounds, 3 clients, 2 per round, checkpoint every round)."""
    raw = {
        "seed": 0, "output_dir": str(tmp / "run"), "model": {"name": "tiny-llama"}, "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 3, "partition": {"method": "iid"}},
        "train": {"local_steps": 2, "batch_size": 4, "lr": 1e-2, "max_length": 64, "dtype": "fp32"},  # exact values
        "checkpoint": {"every": 1}, "logging": {"progress": False, "quiet": True},
    }
    for key, value in sections.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value
    return raw


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """``(run_dir, raw recipe)`` of an uninterrupted 3-round run with round-0001, round-0002 and final/."""
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    tmp = tmp_path_factory.mktemp("reliability")
    data = write_jsonl(tmp / "arith.jsonl", arith_records(48))
    raw = tiny_raw(tmp, data)
    result = run(parse_recipe(raw))
    return result.run_dir, raw


@pytest.fixture
def run_copy(finished_run, tmp_path):
    """A private copy of the finished run (to damage), and its raw recipe pointing at the copy."""
    src, raw = finished_run
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst, {**raw, "output_dir": str(dst)}
