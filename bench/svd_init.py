"""FRLoRA's SVD init, exact vs randomized, on real weights (SmolLM2-135M-Instruct's LoRA targets).

For every rank, times ``fedllm.models.lowrank.principal_factors`` over all LoRA target weights (q/k/v/o of the
30 layers: 120 matrices) with ``torch.linalg.svd`` and with seeded ``torch.svd_lowrank``, and reports the
relative error of the rank-r reconstruction ``‖W − s·B0A0‖_F / ‖W‖_F`` (pooled over the matrices) of
each. Not a test: timings depend on the machine. Target: randomized ≥ 10× faster with an error within
1% of the exact one (``err_rand / err_exact − 1 ≤ 0.01``).

    python bench/svd_init.py                       # r = 8, 16, 32; niter 4, oversample 8
    python bench/svd_init.py --ranks 16 --niter 2 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fedllm.models.loading import load_model, lora_layers
from fedllm.models.lowrank import dense_weight, principal_factors
from fedllm.recipe.schema import LoraConfig, ModelConfig


def target_weights(model_name: str) -> list[torch.Tensor]:
    """The fp32 weights of the model's default LoRA targets."""
    loaded = load_model(ModelConfig(name=model_name), LoraConfig(r=8, alpha=16))
    return [dense_weight(layer) for layer in lora_layers(loaded.model).values()]


def init_all(weights: list[torch.Tensor], rank: int, method: str, niter: int, oversample: int) -> tuple[float, float]:
    """``(seconds, pooled relative error)`` of FRLoRA's init over ``weights`` (scale s = 2)."""
    scale = 2.0
    start = time.perf_counter()
    factors = [principal_factors(w, rank, scale, method, niter, oversample, seed=i) for i, w in enumerate(weights)]
    seconds = time.perf_counter() - start
    err = sum(float(torch.linalg.norm(w - scale * b @ a) ** 2) for w, (b, a) in zip(weights, factors, strict=True))
    norm = sum(float(torch.linalg.norm(w) ** 2) for w in weights)
    return seconds, (err / norm) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--niter", type=int, default=4)
    parser.add_argument("--oversample", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="best of N interleaved timings")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    weights = target_weights(args.model)
    shapes = sorted({tuple(w.shape) for w in weights})
    print(f"{args.model}: {len(weights)} target weights {shapes}, loaded in {time.perf_counter() - t0:.1f}s, "
          f"{torch.get_num_threads()} threads, niter={args.niter}, oversample={args.oversample}")
    rows = []
    header = f"{'r':>4} {'exact s':>9} {'random s':>9} {'speed-up':>9} {'err exact':>10} {'err random':>11} {'err ratio-1':>12}"
    print(header)
    for rank in args.ranks:
        runs: dict[str, list[tuple[float, float]]] = {"exact": [], "randomized": []}
        for _ in range(args.repeats):  # interleaved, so both methods see the same machine load
            for method, timings in runs.items():
                timings.append(init_all(weights, rank, method, args.niter, args.oversample))
        exact, rand = (min(runs[m], key=lambda x: x[0]) for m in ("exact", "randomized"))
        row = {"r": rank, "exact_s": exact[0], "randomized_s": rand[0], "speedup": exact[0] / rand[0],
               "err_exact": exact[1], "err_randomized": rand[1], "err_excess": rand[1] / exact[1] - 1}
        rows.append(row)
        print(f"{rank:>4} {row['exact_s']:>9.3f} {row['randomized_s']:>9.3f} {row['speedup']:>8.1f}x "
              f"{row['err_exact']:>10.5f} {row['err_randomized']:>11.5f} {row['err_excess']:>11.3%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "niter": args.niter, "oversample": args.oversample, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
