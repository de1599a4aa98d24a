"""Bytes a checkpoint writes and keeps for a strategy that changes the base (not a test; ~1 min on 2 cores).

Measured: FRLoRA on MiniLM-L6 (preset ``minilm-l6``, LoRA r = 8 on its default targets, a new classification
head), 4 clients, 2 per round, 3 rounds, a checkpoint every round, on synthetic arithmetic problems. Prints, for
``checkpoints/`` (hard-linked files counted once), the bytes each round's checkpoint wrote (files new to it) and
the bytes kept, beside the adapter's and the dense base's sizes. Computed from shapes: the same for LLaMA-2-7B
(32 layers, q/k/v/o of 4096 × 4096, rank ``--llama-r``, fp32 factors as fedllm keeps them).

    python bench/checkpoint_bytes.py                          # this tree (PYTHONPATH) after the base history
    PYTHONPATH=/path/to/an/older/fedllm python bench/checkpoint_bytes.py   # before, for comparison
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def measure(out: Path) -> dict:
    from fedllm.data.synthetic import arith_splits
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    train, _ = arith_splits(200, 0)
    data = out / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in train))
    raw = {
        "seed": 0, "output_dir": str(out / "run"), "model": {"name": "minilm-l6"}, "lora": {"r": 8, "alpha": 16},
        "data": {"path": str(data), "format": "classification", "fields": {"text": "question", "label": "category"}},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 3, "strategy": "frlora",
                       "partition": {"method": "iid"}},
        "train": {"local_steps": 2, "batch_size": 8, "lr": 1e-3, "max_length": 48, "dtype": "fp32"},  # fp32 base
        "checkpoint": {"every": 1},
        "logging": {"progress": False, "quiet": True},
    }
    run(parse_recipe(raw))
    root = out / "run" / "checkpoints"
    seen: set = set()
    rounds = []
    for ck in sorted(root.glob("round-*")):
        written = 0
        for p in sorted(ck.iterdir()):
            inode = (p.stat().st_dev, p.stat().st_ino)
            if inode not in seen:
                seen.add(inode)
                written += p.stat().st_size
        rounds.append({"checkpoint": ck.name, "written": written,
                       "apparent": sum(p.stat().st_size for p in ck.iterdir())})
    first = min(root.glob("round-*"))
    return {"rounds": rounds, "kept": sum(r["written"] for r in rounds),
            "adapter": (first / "adapter.safetensors").stat().st_size,
            "dense_base": (first / "base.safetensors").stat().st_size}


def llama_7b(r: int) -> dict:
    """LLaMA-2-7B, q/k/v/o: bytes from shapes (fp32 factors; the base fp32 merged or a bf16 base's fp32 residual)."""
    layers, d, modules = 32, 4096, 4
    factors = layers * modules * 2 * d * r * 4  # B (d × r) and A (r × d) of every wrapped weight, fp32
    base_fp32 = layers * modules * d * d * 4
    return {"r": r, "adapter": factors, "dense_base_fp32": base_fp32, "dense_base_bf16": base_fp32 // 2,
            # before: every checkpoint wrote adapter + FRLoRA's (B0, A0) + the dense base (fp32 merged; a bf16 base
            # kept its change as a dense fp32 residual in strategy.safetensors: the same 8.6 GB)
            "before_per_round": 2 * factors + base_fp32,
            # after: adapter + (B0, A0) + the round's (B̄, Ā); once per snapshot (B0, A0) again; the snapshot is
            # rewritten when the log outgrows it, i.e. every base / factors = d / (2r) rounds
            "after_per_round": 3 * factors, "rounds_per_snapshot": base_fp32 // factors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--llama-r", type=int, default=16)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"minilm_frlora_r8": measure(Path(tmp)), "llama2_7b": llama_7b(opts.llama_r)}
    m = result["minilm_frlora_r8"]
    print(f"MiniLM-L6 FRLoRA r=8: adapter {m['adapter'] / 1e6:.2f} MB, dense base {m['dense_base'] / 1e6:.2f} MB")
    for r in m["rounds"]:
        print(f"  {r['checkpoint']}: wrote {r['written'] / 1e6:.2f} MB (apparent size {r['apparent'] / 1e6:.2f} MB)")
    print(f"  checkpoints/ keeps {m['kept'] / 1e6:.2f} MB "
          f"(limit: one dense base + 3 x adapter per checkpoint = "
          f"{(m['dense_base'] + 3 * m['adapter'] * len(m['rounds'])) / 1e6:.2f} MB)")
    ll = result["llama2_7b"]
    print(f"LLaMA-2-7B q/k/v/o r={ll['r']} (from shapes): per round before {ll['before_per_round'] / 1e9:.2f} GB, "
          f"after {ll['after_per_round'] / 1e9:.3f} GB; a snapshot ({ll['dense_base_fp32'] / 1e9:.2f} GB) every "
          f"~{ll['rounds_per_snapshot']} rounds of log")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
