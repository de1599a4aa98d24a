"""Client-parallel simulation over two CPU processes gives the single-process result.

Per-client state (optimizer moments, private factors, control variates) is gathered to every
process after each round, so a client trained by rank 1 in one round and by rank 0 in the next
continues from exactly what it kept (DESIGN.md §3).
"""

import itertools
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fedllm.config import parse_recipe
from fedllm.server import run

PORTS = itertools.count(29533)

# strategy, strategy_args, extra sections: each keeps per-client state across rounds, and with 3 of
# 4 clients per round over 3 rounds some client is trained by different ranks in different rounds.
STATEFUL = {
    "fedavg": ("fedavg", {}, {}),
    "frlora-moments": ("frlora", {}, {"train": {"optimizer_state": "per_client"}}),
    "pfedloru": ("pfedloru", {"personal_r": 2, "personal_steps": 1, "tau": 2}, {}),
    "scaffold": ("scaffold", {}, {}),
    "fedloru": ("fedloru", {"tau": 2, "reinit": "momentum"}, {"train": {"optimizer_state": "per_client"}}),
    "fedadam": ("fedadam", {"eta": 1e-2}, {}),
    # client-level DP around a server optimiser: the noise (fixed seed) and adaptive norm agree on every rank
    "fedadam-dp": ("fedadam", {"eta": 1e-2}, {"privacy": {"mechanism": "central", "noise_multiplier": 0.5,
                                                          "clipping_norm": 0.05, "noise_seed": 3,
                                                          "adaptive_clipping": {"enabled": True, "count_stddev": 1}}}),
    "pflmf": ("pflmf", {"rank": 3, "eta_u": 0.5}, {"train": {"optimizer_state": "per_client"}}),
    "fedsa_lora": ("fedsa_lora", {}, {"train": {"optimizer_state": "per_client"}}),
    "flora": ("flora", {"client_ranks": [4, 1, 2, 4]}, {}),
    "flexlora": ("flexlora", {"client_ranks": [4, 1, 2, 4]}, {}),
}


def two_processes(raw: dict, tmp_path, name: str = "two", *options: str):
    """Run ``raw`` under torchrun with 2 gloo processes (``options``: e.g. ``--resume``); return the run directory."""
    raw = {**raw, "output_dir": str(tmp_path / name)}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", str(next(PORTS)), "-m", "fedllm",
                           "train", str(path), *options], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / name


def final_tensors(run_dir) -> dict[str, dict[str, torch.Tensor]]:
    return {part: load_file(str(p)) for part in ("adapter", "base", "strategy", "clients")
            if (p := run_dir / "final" / f"{part}.safetensors").is_file()}


def assert_same(single: dict, other: dict, tol: float = 1e-6) -> None:
    assert single.keys() == other.keys()
    for part, tensors in single.items():
        assert tensors.keys() == other[part].keys(), part
        worst = max((float((tensors[k] - other[part][k]).abs().max()) for k in tensors), default=0.0)
        assert worst <= tol, f"{part}: max abs difference {worst}"


def test_two_processes_match_one(tiny_recipe, tmp_path):
    raw = tiny_recipe(federation={"rounds": 2, "clients_per_round": 3})
    single = run(parse_recipe(raw))
    two = two_processes(raw, tmp_path)
    a = load_file(str(single.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(two / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (two / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # only rank 0 writes


@pytest.mark.parametrize("case", sorted(STATEFUL))
def test_per_client_state_follows_the_client_across_processes(case, tiny_recipe, arith_file, tmp_path):
    strategy, args, sections = STATEFUL[case]
    raw = tiny_recipe(federation={"num_clients": 4, "clients_per_round": 3, "rounds": 3, "strategy": strategy,
                                  "strategy_args": args}, **sections)
    single = final_tensors(run(parse_recipe(raw)).run_dir)
    assert_same(single, final_tensors(two_processes(raw, tmp_path)))


@pytest.mark.parametrize("case", ["frlora-moments", "scaffold"])
def test_resume_with_a_different_number_of_processes(case, tiny_recipe, tmp_path, crash_at_round):
    """A run checkpointed by 1 process resumes on 2, and one checkpointed by 2 resumes on 1: same final state."""
    strategy, args, sections = STATEFUL[case]
    raw = tiny_recipe(federation={"num_clients": 4, "clients_per_round": 3, "rounds": 3, "strategy": strategy,
                                  "strategy_args": args}, checkpoint={"every": 1}, **sections)
    single = final_tensors(run(parse_recipe(raw)).run_dir)
    # 1 -> 2: one process crashes in round 3 (round 2 is checkpointed); two processes resume it
    crash_at_round(3)
    with pytest.raises(RuntimeError, match="power cut"):
        run(parse_recipe({**raw, "output_dir": str(tmp_path / "one-then-two")}))
    crash_at_round(None)
    assert_same(single, final_tensors(two_processes(raw, tmp_path, "one-then-two", "--resume")))
    # 2 -> 1: a two-process run cut after round 2 (its round-3 results removed); one process resumes it
    cut = two_processes(raw, tmp_path, "two-then-one")
    shutil.rmtree(cut / "final")
    resumed = run(parse_recipe({**raw, "output_dir": str(cut)}), resume=True)
    assert_same(single, final_tensors(resumed.run_dir))
    assert [h["round"] for h in resumed.history if h.get("round")] == [1, 2, 3]


def test_pack_unpack_round_trips_every_dtype_and_shape():
    from fedllm.distributed import pack, unpack

    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.tensor(7.0), torch.tensor([True, False]),
               torch.arange(6, dtype=torch.int64).reshape(2, 3), torch.empty(0, 4), torch.randn(2, 3).t()]
    buffer, layout = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.numel() == sum(t.numel() * t.element_size() for t in tensors)
    back = unpack(buffer, layout)
    assert all(b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t) for b, t in zip(back, tensors,
                                                                                               strict=True))
