"""DP-SGD's per-example clipping by opacus's ``hooks`` vs ``ghost`` (``privacy.grad_sample_mode``): step time and
peak memory, measured side by side (not a test).

One LoRA model of a preset, one fixed batch of ``--batch`` sequences of ``--max-length`` tokens (instruction records
of random words: prompt and answer, response-only loss), SGD; each step is what a DP-SGD client does: the per-example
losses' forward, opacus's backward (hooks: per-example gradients of every LoRA tensor; ghost: the norms' pass and
the clipped pass), clipping, noise and the optimizer step (``fedllm.privacy.dp_sgd.LocalDPSGD``). The two modes run
interleaved: each trial runs one phase of each mode (order alternating between trials), a warm-up step then
``--steps`` timed steps. Memory is the step's peak resident memory above what the process held just before it (the
kernel's high-water mark, reset before each step through ``/proc/self/clear_refs``; glibc's mmap threshold is pinned
so that freed tensors leave the process and the next step starts from the same base).

    python bench/dp_sgd_modes.py --model tiny-llama --batch 8 --max-length 64 --lora-r 8
    python bench/dp_sgd_modes.py --model smollm2-135m-instruct --batch 8 --max-length 128 --lora-r 8 --trials 3 --steps 2

Prints per trial the median step seconds and peak MiB of each mode with ghost/hooks ratios, then the medians over
trials (docs/privacy.md has the figures).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

MMAP_THRESHOLD = "131072"

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != MMAP_THRESHOLD:  # pin it before any allocation: re-run this script
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD})

import torch  # noqa: E402

from fedllm.data.collate import collate  # noqa: E402
from fedllm.engine.server import build_federation  # noqa: E402
from fedllm.models.loading import resolve_task  # noqa: E402
from fedllm.privacy.dp_sgd import LocalDPSGD, ghost_fallback_layers  # noqa: E402
from fedllm.privacy.secret_streams import secret_of_seed  # noqa: E402
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import ModelConfig  # noqa: E402

MODES = ("hooks", "ghost")
WORDS = ("alpha", "beta", "gamma", "delta", "sum", "of", "the", "numbers", "seven", "eleven", "plus", "minus")


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def write_data(path: Path, n: int, words: int, seed: int) -> None:
    """Records of both formats: ``question``/``answer`` (instruction) and ``text``/``label`` (classification)."""
    rng = random.Random(seed)
    text = lambda: " ".join(rng.choice(WORDS) for _ in range(words))  # noqa: E731
    path.write_text("".join(json.dumps({"question": text(), "answer": text(), "text": text(), "label": "ab"[i % 2]})
                            + "\n" for i in range(n)))


def step(dp: LocalDPSGD, model: torch.nn.Module, stepper, batch: dict) -> tuple[float, float]:
    """One DP-SGD step: ``(seconds, peak MiB above the memory held before it)``."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base = rss_kib("VmRSS")
    t = time.perf_counter()
    stepper.zero_grad(set_to_none=True)
    total, _ = dp.loss(model, batch)
    total.backward()
    stepper.step()
    seconds = time.perf_counter() - t
    return seconds, (rss_kib("VmHWM") - base) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    opts = ap.parse_args()
    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp, "data.jsonl")
        write_data(data, opts.batch, opts.max_length, opts.seed)  # long enough to fill max_length when tokenized
        classifier = resolve_task(ModelConfig(name=opts.model)) == "classification"
        raw = {"seed": opts.seed, "output_dir": str(Path(tmp, "run")), "model": {"name": opts.model},
               "lora": {"r": opts.lora_r, "alpha": 2 * opts.lora_r, "dropout": 0.0},
               "data": {"path": str(data), "format": "classification"} if classifier else
                       {"path": str(data), "format": "instruction",
                        "fields": {"instruction": "question", "output": "answer"}},
               "federation": {"num_clients": 1, "rounds": 1, "partition": {"method": "iid"}},
               "train": {"local_steps": 1, "batch_size": opts.batch, "lr": 1e-4, "max_length": opts.max_length},
               "privacy": {"mechanism": "dp_sgd", "noise_multiplier": 1.0, "clipping_norm": 1.0, "noise_seed": 0},
               "logging": {"progress": False, "quiet": True}}
        fed = build_federation(parse_recipe(raw))
    model = fed.loaded.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    batch = collate([fed.data.examples[i] for i in fed.data.clients[0]], fed.loaded.tokenizer.pad_token_id,
                    fed.loaded.task)
    assert len(batch["input_ids"]) == opts.batch, "every record is one training example"
    lengths = batch["attention_mask"].sum(dim=1).float()
    loss = "one label each" if classifier else \
        f"mean supervised {(batch['labels'][:, 1:] != -100).sum(dim=1).float().mean():.0f}"
    numel = sum(p.numel() for p in params)
    print(f"{opts.model}: LoRA r={opts.lora_r}, {numel:,} trainable parameters in {len(params)} tensors; batch "
          f"{opts.batch} x {batch['input_ids'].shape[1]} tokens (mean length {lengths.mean():.0f}, "
          f"{loss}); per-example gradients (hooks) {opts.batch * numel * 4 / 2**20:.1f} MiB; "
          f"ghost fallback layers: {ghost_fallback_layers(model) or 'none'}; torch threads {opts.threads}")
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    print(f"{'trial':>5} {'hooks s/step':>12} {'ghost s/step':>12} {'ratio':>6} {'hooks MiB':>9} {'ghost MiB':>9} "
          f"{'ratio':>6}")
    for trial in range(opts.trials):
        row = {}
        for mode in MODES if trial % 2 == 0 else MODES[::-1]:
            dp = LocalDPSGD(1.0, 1.0, opts.batch, opts.batch, secret_of_seed(trial), grad_sample_mode=mode)
            with dp.phase(model, torch.optim.SGD(params, lr=1e-4)) as stepper:
                step(dp, model, stepper, batch)  # warm-up
                measured = [step(dp, model, stepper, batch) for _ in range(opts.steps)]
            row[mode] = (statistics.median(s for s, _ in measured), statistics.median(m for _, m in measured))
            results[mode].append(row[mode])
        (hs, hm), (gs, gm) = row["hooks"], row["ghost"]
        print(f"{trial + 1:>5} {hs:>12.4f} {gs:>12.4f} {gs / hs:>6.2f} {hm:>9.1f} {gm:>9.1f} {gm / hm:>6.2f}")
    hs, gs = (statistics.median(s for s, _ in results[m]) for m in MODES)
    hm, gm = (statistics.median(x for _, x in results[m]) for m in MODES)
    ratios = [g[0] / h[0] for h, g in zip(results["hooks"], results["ghost"], strict=True)]
    print(f"{'median':>5} {hs:>12.4f} {gs:>12.4f} {gs / hs:>6.2f} {hm:>9.1f} {gm:>9.1f} {gm / hm:>6.2f}   "
          f"(time ratio per trial {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
