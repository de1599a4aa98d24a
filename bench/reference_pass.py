"""CPU-seconds of DPO's reference pass per 100 pairs: client by client in order (fedllm before) against one
length-sorted pass over every client's pairs (``fedllm.engine.reference.compute_references``), docs/preference.md.

    python bench/reference_pass.py --pairs 100 --clients 8 --threads 1 --shape chatbotpa
    python bench/reference_pass.py --pairs 100 --clients 10 --threads 1 --shape arith --batch-size 4

Builds SmolLM2-135M at its real shapes from fedllm's shipped config (random weights: the cost does not depend on
them) with LoRA r=8 on q/v, and random-token pairs: ``chatbotpa`` draws prompt and answer lengths log-normally
(median 24 and 32 tokens, capped at 256 in all; Fed-ChatbotPA's pairs vary this much) over clients of skewed sizes;
``arith`` gives every pair the quickstart's shape (a 12-token prompt, 8-token answers). Times each way once per
trial, interleaved, in fp32; prints CPU-seconds per 100 pairs of each and their ratio, and checks that the two
tables agree (fp32, 1e-6 relative).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch


def _pairs(shape: str, n: int, vocab: int, gen: torch.Generator) -> list[dict]:
    out = []
    for _ in range(n):
        if shape == "arith":
            prompt_len, answers = 12, (8, 8)
        else:
            draw = torch.distributions.LogNormal(torch.tensor([3.2, 3.5, 3.5]), 0.8).sample()
            prompt_len = int(draw[0].clamp(2, 128))
            answers = tuple(int(x.clamp(1, 256 - prompt_len)) for x in draw[1:])
        prompt = torch.randint(5, vocab, (prompt_len,), generator=gen).tolist()
        rows = []
        for length in answers:
            answer = torch.randint(5, vocab, (length,), generator=gen).tolist()
            rows.append((prompt + answer, [-100] * prompt_len + answer))
        out.append({"input_ids": rows[0][0], "labels": rows[0][1],
                    "rejected_input_ids": rows[1][0], "rejected_labels": rows[1][1]})
    return out


def _clients(n: int, k: int, gen: torch.Generator) -> dict[int, list[int]]:
    """``k`` clients of skewed sizes (every one at least one pair), contiguous indices."""
    weights = torch.distributions.Dirichlet(torch.full((k,), 0.7)).sample()
    sizes = (weights * (n - k)).floor().long() + 1
    sizes[0] += n - int(sizes.sum())
    out, start = {}, 0
    for c, size in enumerate(sizes.tolist()):
        out[c] = list(range(start, start + size))
        start += size
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the timing; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--shape", choices=["chatbotpa", "arith"], default="chatbotpa")
    parser.add_argument("--batch-size", type=int, default=8, help="train.batch_size (pairs per batch)")
    parser.add_argument("--trials", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedllm.data.collate import collate
    from fedllm.engine.reference import compute_reference, compute_references
    from fedllm.models.info import shipped_config_dir
    from fedllm.models.loading import attach_lora
    from fedllm.recipe.schema import LoraConfig, TrainConfig

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    config = AutoConfig.from_pretrained(shipped_config_dir("smollm2-135m-instruct"))
    model = attach_lora(AutoModelForCausalLM.from_config(config),
                        LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]), "causal_lm")
    examples = _pairs(args.shape, args.pairs, config.vocab_size, gen)
    clients = _clients(args.pairs, args.clients, gen)
    cfg = TrainConfig(local_steps=1, objective="dpo", batch_size=args.batch_size, dtype="fp32")
    batch = functools.partial(collate, pad_id=0)
    ways = {
        "per_client": lambda: {c: compute_reference(model, examples, ix, cfg, batch) for c, ix in clients.items()},
        "sorted_pass": lambda: compute_references(model, examples, clients, cfg, batch),
    }
    seconds: dict[str, list[float]] = {w: [] for w in ways}
    tables = {}
    for _ in range(args.trials):
        for way, fn in ways.items():
            t0 = time.process_time()
            tables[way] = fn()
            seconds[way].append(time.process_time() - t0)
    for c in clients:
        torch.testing.assert_close(tables["sorted_pass"][c], tables["per_client"][c], rtol=1e-6, atol=0)
    sizes = sorted(len(ix) for ix in clients.values())
    lengths = [max(len(e["input_ids"]), len(e["rejected_input_ids"])) for e in examples]
    print(f"{args.pairs} pairs ({args.shape}; pair widths {min(lengths)}-{max(lengths)}, median "
          f"{statistics.median(lengths)}), {args.clients} clients of {sizes} pairs, batch {args.batch_size}, "
          f"threads {torch.get_num_threads()}")
    per_100 = {w: statistics.median(s) * 100 / args.pairs for w, s in seconds.items()}
    for way, value in per_100.items():
        print(f"{way:12s} {value:8.2f} CPU-s per 100 pairs")
    print(f"ratio sorted_pass / per_client: {per_100['sorted_pass'] / per_100['per_client']:.3f}; tables agree "
          "(fp32, 1e-6 relative)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
