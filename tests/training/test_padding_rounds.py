"""Padded fraction per round in metrics.jsonl; train.group_by_length lowers it and resumes bit-exactly."""

import json

import pytest
import torch
from safetensors.torch import load_file

from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe


def _lines(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _recipe(tiny_recipe, ragged_file, out, **train):
    return parse_recipe(tiny_recipe(output_dir=str(out), data={"path": str(ragged_file)},
                                    federation={"rounds": 3, "num_clients": 2, "clients_per_round": 2},
                                    train={"local_steps": 3, "batch_size": 4, "max_length": 96, **train},
                                    checkpoint={"every": 1}))


def test_padded_fraction_is_reported_and_grouping_lowers_it(tiny_recipe, ragged_file, tmp_path):
    plain = run(_recipe(tiny_recipe, ragged_file, tmp_path / "plain"))
    grouped = run(_recipe(tiny_recipe, ragged_file, tmp_path / "grouped", group_by_length=True))
    p = [x["padded_fraction"] for x in _lines(plain.run_dir)]
    g = [x["padded_fraction"] for x in _lines(grouped.run_dir)]
    assert len(p) == 3 and all(0 < x < 1 for x in p)
    assert sum(g) < 0.6 * sum(p), (g, p)


def test_group_by_length_resumes_bit_exactly(tiny_recipe, ragged_file, tmp_path, crash_at_round):
    full = run(_recipe(tiny_recipe, ragged_file, tmp_path / "full", group_by_length=True))
    recipe = _recipe(tiny_recipe, ragged_file, tmp_path / "cut", group_by_length=True)
    crash_at_round(2)
    with pytest.raises(RuntimeError, match="power cut"):
        run(recipe)
    crash_at_round(None)
    resumed = run(recipe, resume=True)
    a = load_file(str(full.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(resumed.run_dir / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [x["padded_fraction"] for x in _lines(full.run_dir)] == [x["padded_fraction"] for x in _lines(resumed.run_dir)]
