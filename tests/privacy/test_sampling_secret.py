"""Issue 34: under client-level DP the client sample is drawn from a secret seed, not from the recipe's ``seed``
(which every export's card and recipe state); it is kept in the run's checkpointed state, so a resume continues
the same samples, and it is written to no exported file."""

import json
import shutil

import torch
from safetensors.torch import load_file

from fedllm.engine.server import run, sample_clients
from fedllm.export import export
from fedllm.recipe.checks import parse_recipe
from fedllm.runs import checkpoint as ckpt_io

DP = {"mechanism": "central", "noise_multiplier": 1.0, "clipping_norm": 0.5, "delta": 1e-3}
N, M, ROUNDS = 12, 2, 4  # a secret seed reproduces the recipe seed's 4 samples with probability (1/66)^4 ≈ 5e-8


def dp_run(tiny_recipe, out, **privacy):
    raw = tiny_recipe(
        output_dir=str(out),
        federation={"rounds": ROUNDS, "num_clients": N, "clients_per_round": M},
        privacy={**DP, **privacy},
        checkpoint={"every": 1},
    )
    return parse_recipe(raw), run(parse_recipe(raw))


def samples(run_dir):
    return [
        x["clients"] for x in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "clients" in x
    ]


def sampling_secret(checkpoint_dir) -> bytes:
    return bytes(ckpt_io.load_checkpoint(checkpoint_dir).strategy["privacy/sampling_secret"].tolist())


def test_the_sample_under_dp_is_drawn_from_a_secret_seed_not_the_recipe_seed(tiny_recipe, tmp_path):
    recipe, result = dp_run(tiny_recipe, tmp_path / "a")
    secret = sampling_secret(result.run_dir / "final")
    drawn = samples(result.run_dir)
    assert len(secret) == 32 and drawn == [sample_clients(secret, r, N, M) for r in range(1, ROUNDS + 1)]
    assert drawn != [sample_clients(recipe.seed, r, N, M) for r in range(1, ROUNDS + 1)]  # not recomputable
    _, other = dp_run(tiny_recipe, tmp_path / "b")
    assert sampling_secret(other.run_dir / "final") != secret  # a fresh secret per run


def test_an_export_under_dp_contains_no_sampling_seed(tiny_recipe, tmp_path):
    _, result = dp_run(tiny_recipe, tmp_path / "run")
    secret = sampling_secret(result.run_dir / "final")
    out = export(result.run_dir, "adapter", tmp_path / "adapter").out
    files = [p for p in out.rglob("*") if p.is_file()]
    assert files
    for path in files:
        data = path.read_bytes()
        assert secret not in data and secret.hex().encode() not in data, path
        assert b"sampling_secret" not in data and b"noise_secret" not in data and b'"clients": [' not in data, path


def test_a_resumed_dp_run_continues_the_same_secret_samples_bit_exactly(tiny_recipe, tmp_path):
    recipe, full = dp_run(tiny_recipe, tmp_path / "full")
    cut = tmp_path / "cut"
    shutil.copytree(full.run_dir, cut)
    for gone in (cut / "final", ckpt_io.round_dir(cut, 3), cut / "summary.json"):
        shutil.rmtree(gone) if gone.is_dir() else gone.unlink()
    resumed = run(parse_recipe({**tiny_recipe(), **recipe.to_dict(), "output_dir": str(cut)}), resume=True)
    assert samples(resumed.run_dir) == samples(full.run_dir)
    a, b = (load_file(str(d / "final" / "adapter.safetensors")) for d in (full.run_dir, cut))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
