"""Cost of a DPO step against an SFT step on the same sequences (docs/preference.md, "Measured").

    python bench/preference_step.py --pairs 4 --length 96 --repeats 6

Builds SmolLM2-135M at its real shapes from fedllm's shipped config (random weights: the cost does not depend on
them) with LoRA r=8 on q/k/v/o, and times, interleaved, one optimizer step of

* ``sft``: the next-token loss of the 2B sequences (the B chosen and the B rejected answers) as one batch;
* ``dpo``: the DPO loss of the B pairs with precomputed reference log-probabilities (fedllm's default);
* ``dpo_adapter_disabled``: the DPO loss with the reference computed at every step with the adapter disabled (trl's
  and OpenFedLLM's way without a reference model);

and the one-off cost of computing a batch's reference log-probabilities. Prints the median seconds and the
ratios to ``sft``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv: list[str] | None = None) -> int:
    """Run the timing; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=4, help="pairs per batch (2x as many sequences)")
    parser.add_argument("--length", type=int, default=96, help="tokens per sequence (prompt half, answer half)")
    parser.add_argument("--repeats", type=int, default=6, help="timed steps of each kind (after one warm-up)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedllm.engine.client import micro_batch_loss
    from fedllm.models.info import shipped_config_dir
    from fedllm.models.loading import attach_lora
    from fedllm.models.preference_loss import sequence_logps
    from fedllm.recipe.schema import LoraConfig, PreferenceConfig, TrainConfig

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(shipped_config_dir("smollm2-135m-instruct"))
    model = attach_lora(AutoModelForCausalLM.from_config(config), LoraConfig(r=8, alpha=16), "causal_lm")
    model.train()
    b, n = args.pairs, args.length
    ids = torch.randint(5, config.vocab_size, (2 * b, n))
    labels = ids.clone()
    labels[:, : n // 2] = -100  # the prompt half carries no loss
    mask = torch.ones_like(ids)
    sft_batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    dpo_batch = {**sft_batch, "pairs": torch.tensor(b)}
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6)
    kinds = {
        "sft": (TrainConfig(local_steps=1), sft_batch),
        "dpo": (TrainConfig(local_steps=1, objective="dpo"), dpo_batch),
        "dpo_adapter_disabled": (
            TrainConfig(local_steps=1, objective="dpo", preference=PreferenceConfig(reference="adapter_disabled")),
            dpo_batch,
        ),
    }
    with torch.no_grad():
        dpo_batch["ref_logps"] = sequence_logps(model, dpo_batch).logps
    times: dict[str, list[float]] = {k: [] for k in [*kinds, "reference_once"]}
    for i in range(args.repeats + 1):
        for name, (cfg, batch) in kinds.items():
            batch = {k: v for k, v in batch.items() if name != "dpo_adapter_disabled" or k != "ref_logps"}
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            micro_batch_loss(model, batch, cfg).backward()
            opt.step()
            if i:
                times[name].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            sequence_logps(model.eval(), dpo_batch)
        model.train()
        if i:
            times["reference_once"].append(time.perf_counter() - t0)
    base = statistics.median(times["sft"])
    print(
        f"SmolLM2-135M shapes, LoRA r=8 q/k/v/o, {b} pairs = {2 * b} sequences x {n} tokens, "
        f"{torch.get_num_threads()} threads, median of {args.repeats}:"
    )
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:22s} {med:7.3f} s   x{med / base:.2f} of sft")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
