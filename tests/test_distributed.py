"""Client-parallel simulation over two CPU processes gives the single-process result."""

import os
import subprocess
import sys

import torch
import yaml
from safetensors.torch import load_file

from fedllm.config import parse_recipe
from fedllm.server import run


def test_two_processes_match_one(tiny_recipe, tmp_path):
    raw = tiny_recipe(federation={"rounds": 2, "clients_per_round": 3})
    single = run(parse_recipe(raw))
    raw["output_dir"] = str(tmp_path / "two")
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(raw))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([torchrun, "--nproc_per_node", "2", "--master_port", "29533", "-m", "fedllm", "train",
                           str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = load_file(str(single.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(tmp_path / "two" / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2  # only rank 0 writes
