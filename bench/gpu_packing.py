"""``train.packing`` on a GPU: packed per-sequence losses and LoRA gradients against the padded batch's, and speed.

    python bench/gpu_packing.py --json OUT.json        # on a GPU (cuda); --device cpu runs the same checks here

**Equality** (fedllm's tiny LLaMA, Qwen2 and Gemma, LoRA r=4 with non-zero factors): one right-padded batch of
8 examples (lengths 9-120, prompts without loss) against the same examples packed by
:func:`fedllm.data.packing.pack_batch`, in one row and in rows of 128 positions, for each dtype (fp32, bf16) and
attention the device has (SDPA, eager, and flash-attention 2 where ``flash_attn`` is installed; flash only in
bf16 and in one row, as fedllm picks it). Printed: the largest per-sequence loss difference and the largest LoRA
gradient difference relative to the gradient's largest entry.

**Speed** (``--speed``, SmolLM2-135M's shape from the config fedllm ships, random weights, LoRA r=8 on q/k/v/o,
bf16): forward + backward + AdamW of micro-batches drawn from Alpaca-like lengths
(:mod:`fedllm.data_prep` length-spread: lognormal, median ≈ 160, capped at 512), padded against packed,
interleaved, after a warm-up; tokens/s of real (non-padding) tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedllm.data.collate import collate  # noqa: E402
from fedllm.data.packing import pack_batch, sequence_index  # noqa: E402
from fedllm.data.tokens import IGNORE_INDEX  # noqa: E402
from fedllm.models.loading import load_model  # noqa: E402
from fedllm.models.supervised_loss import supervised_hidden, supervised_positions_loss, token_losses  # noqa: E402
from fedllm.recipe.schema import LoraConfig, ModelConfig  # noqa: E402

LENGTHS = [9, 40, 120, 17, 66, 31, 98, 12]
PROMPTS = [4, 10, 60, 5, 20, 8, 50, 3]


def examples(vocab: int, lengths: list[int], prompts: list[int], seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(lengths, prompts, strict=True):
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * p + ids[p:]})
    return out


def per_sequence(model, batch: dict, count: int, rows_of_examples: list[list[int]] | None = None) -> torch.Tensor:
    """Mean supervised loss of each example; a packed batch's examples found from its position ids."""
    hidden, targets, rows = supervised_hidden(model, batch)
    if "position_ids" in batch:
        keep = batch["labels"][:, 1:] != IGNORE_INDEX
        within = sequence_index(batch["position_ids"])
        if rows_of_examples is not None:  # several packed rows: row r's k-th sequence is example rows[r][k]
            table = torch.full((len(rows_of_examples), int(within.max()) + 1), -1, device=within.device)
            for r, ex in enumerate(rows_of_examples):
                table[r, :len(ex)] = torch.tensor(ex, device=within.device)
            within = table.gather(1, within)
        rows = within[:, :-1][keep]
    losses = token_losses(model, hidden, targets)
    return torch.stack([losses[rows == k].mean() for k in range(count)])


def lora_grads(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}


def equality(device: str, families: list[str], attentions: list[str]) -> list[dict]:
    from fedllm.data.packing import fill_rows

    rows_out = []
    for family in families:
        for dtype in ("fp32", "bf16"):
            model = load_model(ModelConfig(name=f"tiny-{family}"), LoraConfig(r=4, alpha=8, init="gaussian")).model
            gen = torch.Generator().manual_seed(1)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    if "lora_" in n:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            model.to(device=device, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16)
            config = model.get_base_model().config
            exs = examples(config.vocab_size, LENGTHS, PROMPTS)
            padded = {k: v.to(device) for k, v in collate(exs, pad_id=0).items()}
            for attention in attentions:
                if attention == "flash_attention_2" and dtype != "bf16":
                    continue
                config._attn_implementation = attention
                want = per_sequence(model, padded, len(exs))
                want_grads = lora_grads(model, supervised_positions_loss(model, padded))
                layouts = [("one row", None)] + ([] if attention == "flash_attention_2" else [("rows of 128", 128)])
                for layout, row_length in layouts:
                    packed = {k: v.to(device) for k, v in pack_batch({k: v.cpu() for k, v in padded.items()},
                                                                     row_length).items()}
                    rows_of = None if row_length is None else fill_rows(LENGTHS, row_length)
                    got = per_sequence(model, packed, len(exs), rows_of)
                    got_grads = lora_grads(model, supervised_positions_loss(model, packed))
                    grad_rel = max(float((got_grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                                   for n, g in want_grads.items())
                    row = {"model": f"tiny-{family}", "dtype": dtype, "attention": attention, "layout": layout,
                           "max_loss_diff": float((got.float() - want.float()).abs().max()),
                           "max_grad_rel_diff": grad_rel, "loss_mean": float(want.float().mean())}
                    rows_out.append(row)
                    print("gpu_packing: equality", json.dumps(row), flush=True)
                config._attn_implementation = "sdpa"
            del model
    return rows_out


def speed(device: str, steps: int, trials: int, batch: int, attention: str) -> dict:
    """Padded against packed (one row where flash is used, else rows of 512) micro-batches, interleaved."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedllm.models.loading import attach_lora

    config = AutoConfig.from_pretrained(ROOT / "fedllm" / "assets" / "configs" / "smollm2-135m-instruct")
    config._attn_implementation = attention
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    model = attach_lora(base, LoraConfig(r=8, alpha=16), "causal_lm")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    draws = []
    for _ in range(steps * trials * 2 + 2):
        lengths = [int(min(512, max(16, math.exp(torch.randn(1, generator=gen).item() * 0.8 + math.log(160)))))
                   for _ in range(batch)]
        draws.append(examples(config.vocab_size, lengths, [n // 3 for n in lengths], seed=len(draws)))
    flash = attention == "flash_attention_2"

    def step(exs: list[dict], packed: bool) -> int:
        b = collate(exs, pad_id=0)
        if packed:
            b = pack_batch(b, None if flash else 512)
        b = {k: v.to(device) for k, v in b.items()}
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = supervised_positions_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return sum(len(e["input_ids"]) for e in exs)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    step(draws[0], False)
    step(draws[1], True)
    times = {"padded": [], "packed": []}
    tokens = {"padded": 0, "packed": 0}
    k = 2
    for _ in range(trials):
        for mode in ("padded", "packed"):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                tokens[mode] += step(draws[k], mode == "packed")
                k += 1
            sync()
            times[mode].append(time.perf_counter() - t0)
    out = {"attention": attention, "batch": batch, "steps": steps, "trials": trials,
           "tokens_per_s": {m: tokens[m] / sum(times[m]) for m in times}, "seconds": times}
    out["packed_over_padded"] = out["tokens_per_s"]["packed"] / out["tokens_per_s"]["padded"]
    print("gpu_packing: speed", json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--families", default="llama,qwen2,gemma")
    p.add_argument("--speed", action="store_true")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    from transformers.utils import is_flash_attn_2_available

    flash = args.device == "cuda" and is_flash_attn_2_available()
    attentions = ["sdpa", "eager"] + (["flash_attention_2"] if flash else [])
    result = {"python": platform.python_version(), "torch": torch.__version__, "device": args.device,
              "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None, "flash_attn": flash}
    print("gpu_packing:", json.dumps(result), flush=True)
    result["equality"] = equality(args.device, args.families.split(","), attentions)
    if args.speed:
        result["speed"] = [speed(args.device, args.steps, args.trials, args.batch, a)
                           for a in (["sdpa"] + (["flash_attention_2"] if flash else []))]
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
