"""Does ``torch.compile`` pay for a CPU client step? One quickstart-shaped bf16 step, eager vs compiled decoder layers.

    python bench/compile_step.py [--threads 1] [--steps 3]

SmolLM2-135M-Instruct (real weights), bf16 base with fp32 LoRA factors (r=8 on q/k/v/o) under bf16 autocast, one
fixed 4 x 96 micro-batch (60 prompt positions without a loss), fedllm's loss (``micro_batch_loss``) and AdamW, with
fedllm's training context (eager attention, no PEFT input casts). Each decoder layer is compiled in place
(``nn.Module.compile(dynamic=False)``: every code path that calls the layer runs the compiled graph; compiling the
decoder module itself is bypassed by transformers' ``get_decoder()``). Prints the best of ``--steps`` CPU-seconds
per step before and after, the first compiled step's cost, and dynamo's graph count. Real batches vary in width, and
each new width recompiles (``dynamic=False``) — which this fixed batch does not show.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch


def main(argv=None) -> int:
    from torch._dynamo.utils import counters

    from fedllm.engine.client import lora_input_casts_skipped, micro_batch_loss, train_autocast, training_attention
    from fedllm.models.loading import load_model
    from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(ModelConfig(name="smollm2-135m-instruct", dtype="bf16"),
                       LoraConfig(r=8, alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]), 2, 0).model
    cfg = TrainConfig(dtype="bf16", max_length=96, local_steps=1)
    ids = torch.randint(10, 1000, (4, 96), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :60] = -100
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4)

    def step() -> float:
        start = time.process_time()
        opt.zero_grad()
        with train_autocast(torch.device("cpu"), "bf16"):
            loss = micro_batch_loss(model, batch, cfg)
        loss.backward()
        opt.step()
        return time.process_time() - start

    model.train()
    with training_attention(model, cfg), lora_input_casts_skipped(model, cfg):
        step()
        eager = min(step() for _ in range(args.steps))
        for layer in model.get_base_model().model.layers:
            layer.compile(dynamic=False)
        wall = time.perf_counter()
        first = step()
        wall = time.perf_counter() - wall
        compiled = min(step() for _ in range(args.steps))
    print(f"eager {eager:.3f} CPU-s/step; compiled {compiled:.3f} CPU-s/step ({eager / compiled:.2f}x); first compiled "
          f"step {first:.1f} CPU-s ({wall:.1f} s wall); dynamo {dict(counters['stats'])}; "
          f"load average {os.getloadavg()[0]:.1f}, {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
