"""bf16 products on this CPU: torch's own kernel against fedllm's fp32 blocks (:mod:`fedllm.models.cpu_half_matmul`).

    python bench/cpu_half_matmul.py [--trials 2] [--threads 2] [--json OUT]

For each shape, the two layouts of a linear layer's step: the forward ``x @ W.T`` (the weight as stored, which
torch's reference GEMM handles at its best) and the input gradient ``g @ W`` (every linear layer's backward); each
in bf16 with torch's kernel and inside :func:`fedllm.models.cpu_half_matmul.fp32_half_matmuls`, and the same
product in fp32 for scale. The cases run interleaved, trial after trial, so the machine's load moves them alike;
each figure is the best trial's GFLOP/s (wall). The largest difference of the blocks' result from torch's bf16
result is printed in units of bf16's spacing at the product's largest value, with the share of identical elements
(both are fp32 sums rounded once; a difference is the order of the sums). Where oneDNN has a bf16 GEMM (AVX-512)
fedllm does not enter the blocks; the bench still times them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedllm.models.cpu_half_matmul import Fp32HalfMatmuls, native_half_gemm  # noqa: E402

#: (rows, in, out): SmolLM2's MLP at 4 x 96 positions, LLaMA-2-7B's attention and MLP at 1 x 256, one decode row.
SHAPES = [(384, 576, 1536), (256, 4096, 4096), (256, 4096, 11008), (16, 4096, 4096)]


def timed(a: torch.Tensor, b: torch.Tensor, seconds: float = 0.3) -> tuple[float, torch.Tensor]:
    """The best seconds of ``a @ b`` over calls for about ``seconds`` after a first call (a first call longer than
    ``seconds``, torch's reference GEMM at 0.3 GFLOP/s: that call's), and the product."""
    t0 = time.perf_counter()
    product = a @ b
    best = time.perf_counter() - t0
    spent = 0.0 if best <= seconds else seconds
    best = best if best > seconds else float("inf")
    while spent < seconds:
        t0 = time.perf_counter()
        a @ b
        dt = time.perf_counter() - t0
        best, spent = min(best, dt), spent + dt
    return best, product


def apart(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """``(largest difference in units of bf16's spacing at the product's largest value, share of equal elements)``.
    (A near-zero element of a long sum may differ by many of its own units: its fp32 sums' rounding errors are
    the size of the large terms'.)"""
    scale = torch.finfo(torch.bfloat16).eps * float(want.float().abs().max())
    return float((got.float() - want.float()).abs().max()) / scale, float((got == want).float().mean())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows: dict[str, list[float]] = {}
    agree: dict[str, tuple[float, float]] = {}
    for trial in range(args.trials):
        for m, k, n in SHAPES:
            x, w = torch.randn(m, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16()
            g = torch.randn(m, n, generator=gen).bfloat16()
            for layout, a in (("x @ W.T", x), ("g @ W", g)):
                b = w.T if layout == "x @ W.T" else w  # the forward's weight is a transposed view, as F.linear has it
                flops, key = 2 * m * k * n, f"{m}x{k}x{n} {layout}"
                torch_s, want = timed(a, b)
                with Fp32HalfMatmuls():
                    blocks_s, got = timed(a, b)
                fp32_s, _ = timed(a.float(), b.float())
                agree[key] = apart(got, want)
                for case, s in (("torch bf16", torch_s), ("fp32 blocks", blocks_s), ("fp32", fp32_s)):
                    rows.setdefault(f"{key}|{case}", []).append(flops / s / 1e9)
        print(f"trial {trial} done", flush=True)
    load = os.getloadavg()
    print("max diff: the blocks' largest difference from torch's bf16 result in units of bf16's spacing at the "
          "product's largest value; equal: the share of identical elements")
    print(f"\n{args.threads} threads; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}; oneDNN bf16 GEMM: "
          f"{native_half_gemm(torch.bfloat16)}; GFLOP/s, best of {args.trials}")
    print(f"{'rows x in x out':<18} {'product':<8} {'torch bf16':>10} {'fp32 blocks':>11} {'fp32':>7} "
          f"{'blocks/torch':>12} {'max diff':>8} {'equal':>6}")
    for m, k, n in SHAPES:
        for layout in ("x @ W.T", "g @ W"):
            key = f"{m}x{k}x{n} {layout}"
            best = {c: max(rows[f"{key}|{c}"]) for c in ("torch bf16", "fp32 blocks", "fp32")}
            print(f"{m}x{k}x{n:<11} {layout:<8} {best['torch bf16']:>10.1f} {best['fp32 blocks']:>11.1f} "
                  f"{best['fp32']:>7.1f} {best['fp32 blocks'] / best['torch bf16']:>11.1f}x {agree[key][0]:>8.2f} "
                  f"{100 * agree[key][1]:>5.1f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"gflops": rows, "apart": agree, "threads": args.threads, "load": load},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
