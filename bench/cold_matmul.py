"""How fast the model's frozen matmuls run when their weights come from memory rather than cache.

    python bench/cold_matmul.py [--rows 312] [--weights 60] [--reps 3]

A transformer step multiplies each layer's weights once forward and once backward, and 30 layers of SmolLM2-135M
hold ~210 MB of bf16 weights, far more than the cache: each matmul reads a weight that is not in cache. fedllm's
peak probe (:func:`fedllm.models.hardware.probe`) repeats the same matmul, whose weight stays in cache. This bench
times one shape (``rows x 576`` by ``576 x 1536``, SmolLM2's MLP, bf16, 1 thread) both ways, interleaved: the same
weight again and again, and ``--weights`` distinct weights in turn. Prints GFLOP per CPU-second of each.
"""

from __future__ import annotations

import argparse
import time

import torch


def rate(inputs: list[torch.Tensor], weights: list[torch.Tensor], flops: float) -> float:
    """GFLOP per CPU-second of ``x_i @ w_i.T`` over the pairs."""
    start = time.process_time()
    for x, w in zip(inputs, weights, strict=True):
        x @ w.t()
    return len(weights) * flops / (time.process_time() - start) / 1e9


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=312, help="rows of the activation (the quickstart's 4 x 78)")
    p.add_argument("--weights", type=int, default=60)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(1536, 576, generator=gen).to(torch.bfloat16) for _ in range(args.weights)]
    inputs = [torch.randn(args.rows, 576, generator=gen).to(torch.bfloat16) for _ in range(args.weights)]
    flops = 2 * args.rows * 576 * 1536
    rate(inputs[:1] * 5, weights[:1] * 5, flops)  # warm-up
    for rep in range(args.reps):
        cached = rate(inputs[:1] * args.weights, weights[:1] * args.weights, flops)
        fresh = rate(inputs, weights, flops)
        print(f"trial {rep}: one weight, cached {cached:6.0f} GFLOP/CPU-s; {args.weights} weights in turn "
              f"{fresh:6.0f} GFLOP/CPU-s ({fresh / cached:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
