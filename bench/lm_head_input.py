"""The LM head's input in generation's prompt pass, contiguous or not: CPU-seconds side by side, interleaved.

    python bench/lm_head_input.py [--trials 3] [--threads 1]

1. ``F.linear`` of a ``[20, 1, 576]`` slice of ``[20, 38, 576]`` hidden states by SmolLM2-135M's 49,152 x 576 head
   (random weights that require no grad, as a frozen head), as the slice and as a contiguous copy, bf16 and fp32.
2. SmolLM2-135M-Instruct's prompt pass (``logits_to_keep=1``) over 20 quickstart-style prompts, its base frozen as
   under LoRA, with and without ``fedllm.models.lm_head_input``'s hook (the logits compared bit for bit).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cpu_s(fn) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    for dtype in (torch.bfloat16, torch.float32):
        weight = torch.randn(49152, 576, dtype=dtype)
        rows = torch.randn(20, 38, 576, dtype=dtype)[:, -1:, :]
        times = {"slice": [], "contiguous": []}
        for _ in range(args.trials):
            times["slice"].append(cpu_s(lambda: torch.nn.functional.linear(rows, weight)))
            times["contiguous"].append(cpu_s(lambda: torch.nn.functional.linear(rows.contiguous(), weight)))
        print(f"F.linear {str(dtype)[6:]}: slice {median(times['slice']):.3f} CPU-s, contiguous "
              f"{median(times['contiguous']):.3f} (ratio {median(times['slice']) / median(times['contiguous']):.0f}x)")

    from fedllm.models.lm_head_input import MARK
    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    cfg = ModelConfig(name="smollm2-135m-instruct", dtype="bf16")
    tok = load_tokenizer(cfg)
    model = load_base_model(cfg, tok).eval().requires_grad_(False)  # frozen, as under LoRA (a head that requires
    # grad takes another path in torch's matmul, folded and fast: only frozen heads paid)
    head = model.get_output_embeddings()
    hooks = dict(head._forward_pre_hooks)
    prompts = [f"### Instruction:\nA basket has {a} marbles and gets {2 * a + 7} more. How many marbles are in it "
               f"now?\n\n### Response:\n" for a in range(11, 31)]
    tok.padding_side = "left"
    enc = tok(prompts, return_tensors="pt", padding=True)
    times, logits = {"without": [], "with": []}, {}
    with torch.no_grad():
        for _ in range(args.trials):
            for name in ("without", "with"):
                head._forward_pre_hooks.clear()
                if name == "with":
                    head._forward_pre_hooks.update(hooks)
                start = time.process_time()
                logits[name] = model(**enc, logits_to_keep=1).logits
                times[name].append(time.process_time() - start)
    print(f"SmolLM2-135M prompt pass, {tuple(enc['input_ids'].shape)} tokens, bf16, {args.threads} thread(s): "
          f"without the hook {median(times['without']):.2f} CPU-s, with it {median(times['with']):.2f} "
          f"(ratio {median(times['without']) / median(times['with']):.1f}x); logits equal: "
          f"{torch.equal(logits['with'], logits['without'])}; hooked at load: {getattr(head, MARK)}")


if __name__ == "__main__":
    main()
