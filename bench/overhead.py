"""Federated overhead and memory: fedllm's round loop vs a plain PEFT training loop.

    python bench/overhead.py [--model smollm2-135m-instruct] [--steps 40]

(a) FedAvg with one client per round (1 client, R rounds x S local steps) and
(b) a plain PEFT loop (AdamW, the same examples, batch size and number of
optimizer steps) run side by side in this process on the same model; prints the
wall time of both and the ratio. Then peak resident memory of a short run with
10 vs 1000 clients in the partition (each in a fresh subprocess).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from fedllm.data.collate import collate
from fedllm.data.synthetic import generate_arith
from fedllm.engine.client import BatchStream
from fedllm.engine.server import RoundLoop, build_federation
from fedllm.recipe.checks import parse_recipe


def recipe(model: str, data: Path, out: Path, clients: int, rounds: int, steps: int):
    return parse_recipe({
        "seed": 0, "output_dir": str(out), "model": {"name": model}, "lora": {"r": 8, "alpha": 16},
        "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": clients, "clients_per_round": 1, "rounds": rounds,
                       "partition": {"method": "iid"}},
        "train": {"local_steps": steps, "batch_size": 8, "lr": 1e-4, "max_length": 128},
        "logging": {"progress": False, "quiet": True}})


def plain_peft_loop(fed, steps: int) -> float:
    """The baseline: the same model, examples and steps in a bare PEFT + AdamW loop."""
    model, data = fed.loaded.model, fed.data
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    stream = BatchStream(data.clients[0], 8, seed=0)
    model.train()
    start = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(**coll([data.examples[i] for i in stream.next()])).loss.backward()
        opt.step()
    return time.perf_counter() - start


def peak_rss_child(args) -> None:
    """Run a short federation and print peak RSS in MiB (used in a subprocess)."""
    fed = build_federation(recipe(args.model, Path(args.data), Path(args.out), args.clients, 2, 2))
    Path(args.out).mkdir(parents=True)
    RoundLoop(fed, Path(args.out), progress=False).run()
    print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="local steps per round")
    p.add_argument("--trials", type=int, default=2, help="interleaved timing trials of each loop")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--clients", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return peak_rss_child(args)
    tmp = Path(tempfile.mkdtemp())
    data = tmp / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_arith(2000, seed=0)))
    total = args.rounds * args.steps

    fed = build_federation(recipe(args.model, data, tmp / "fed", 1, args.rounds, args.steps))
    plain_peft_loop(fed, 2)  # warm-up (allocator, kernels) before either timing
    fed_times, plain_times = [], []
    for trial in range(args.trials):  # interleaved, so drift of the machine hits both alike
        run_dir = tmp / f"fed{trial}"
        run_dir.mkdir()
        loop = RoundLoop(fed, run_dir, progress=False)
        t0 = time.perf_counter()
        loop.run()
        fed_times.append(time.perf_counter() - t0)
        plain_times.append(plain_peft_loop(fed, total))
    fed_s, plain_s = min(fed_times), min(plain_times)
    print(f"model={args.model} optimizer steps={total} (rounds={args.rounds} x local_steps={args.steps}), batch 8, "
          f"best of {args.trials} interleaved trials")
    print("| loop | wall s (each trial) | best s/step |\n|---|---|---|")
    print(f"| plain PEFT + AdamW | {', '.join(f'{t:.2f}' for t in plain_times)} | {plain_s / total:.3f} |")
    print(f"| fedllm FedAvg, 1 client/round (state load/read, aggregation, metrics, final checkpoint) "
          f"| {', '.join(f'{t:.2f}' for t in fed_times)} | {fed_s / total:.3f} |")
    print(f"federated overhead: {100 * (fed_s / plain_s - 1):+.1f}% (ratio {fed_s / plain_s:.3f})")

    rss = {}
    for n in (10, 1000):
        out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--clients", str(n),
                              "--data", str(data), "--out", str(tmp / f"mem{n}")],
                             capture_output=True, text=True, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        rss[n] = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mib"]
    print(f"peak RSS: 10 clients {rss[10]:.0f} MiB, 1000 clients {rss[1000]:.0f} MiB, "
          f"ratio {rss[1000] / rss[10]:.3f}")


if __name__ == "__main__":
    main()
