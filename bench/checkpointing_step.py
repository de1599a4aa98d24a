"""CPU time of one client step with and without ``train.gradient_checkpointing`` (SmolLM2-135M, LoRA on q/v, bf16
autocast), interleaved trials in one process so both sides see the same machine load.

    python bench/checkpointing_step.py                 # the quickstart's shape (4 x 96) and 8 x 256
    python bench/checkpointing_step.py --trials 8 --shape 4x96
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--shape", action="append", help="BxS (default: 4x96 and 8x256)")
    args = ap.parse_args()
    import torch

    from fedllm.engine.checkpointed import checkpointed_training
    from fedllm.engine.client import micro_batch_loss, train_autocast
    from fedllm.models.loading import load_model
    from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig

    torch.set_num_threads(2)
    loaded = load_model(ModelConfig(name="smollm2-135m-instruct", dtype="bf16"),
                        LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    model = loaded.model
    model.train()
    print("| b x s | CPU-s per step, off | on | on / off | trials |")
    print("|---|---:|---:|---:|---:|")
    for shape in args.shape or ["4x96", "8x256"]:
        b, s = (int(x) for x in shape.split("x"))
        ids = torch.randint(3, len(loaded.tokenizer), (b, s), generator=torch.Generator().manual_seed(0))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        times: dict[bool, list[float]] = {False: [], True: []}
        for trial in range(args.trials + 1):  # the first pair warms up
            for on in (False, True) if trial % 2 else (True, False):
                cfg = TrainConfig(dtype="bf16", max_length=s, gradient_checkpointing=on)
                model.zero_grad(set_to_none=True)
                t0 = time.process_time()
                with checkpointed_training(model, cfg), train_autocast(torch.device("cpu"), "bf16"):
                    loss = micro_batch_loss(model, batch, cfg)
                loss.backward()
                if trial:
                    times[on].append(time.process_time() - t0)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {b} x {s} | {off:.3f} | {on:.3f} | {on / off:.2f}x | {args.trials} |", flush=True)


if __name__ == "__main__":
    main()
