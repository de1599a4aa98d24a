"""Where a GPU client step's time goes, and what removes the host overhead: eager, fused AdamW, compiled layers, CUDA graphs.

    python bench/gpu_step.py --json OUT.json          # on a GPU; --device cpu --tiny runs the same code here

docs/gpu.md found fedllm's GPU loop host-bound: at 8 x 128 a SmolLM2-shaped bf16 micro-batch takes ~0.19 s of which
the GPU is busy ~15 ms (about 4,000 kernel launches per step). This times one client step (fedllm's loss
``micro_batch_loss`` under ``train_autocast`` and ``training_attention``, backward, AdamW step, zero_grad) on the
model shapes fedllm ships (``fedllm/assets/configs/<preset>/config.json``, random weights, bf16 base, fp32 LoRA
factors r=8 on q/k/v/o), one fixed batch per shape, for each variant:

- ``eager``: fedllm's client step as it runs today (foreach AdamW);
- ``fused-adamw``: the same with ``torch.optim.AdamW(fused=True)``;
- ``compiled``: every decoder layer compiled in place (``nn.Module.compile(dynamic=False)``, inductor's default mode);
- ``cudagraphs``: the same with ``mode="reduce-overhead"`` (inductor + CUDA graphs).

Each variant gets a fresh model from the same seed, a warm-up (compilation included; its seconds printed apart),
then ``--steps`` timed steps; variants are interleaved over ``--trials`` (the best trial's mean is printed). The
loss after the timed steps is printed beside eager's: compiled kernels fuse bf16 arithmetic differently, so equal
losses are not expected, only close ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

VARIANTS = ("eager", "fused-adamw", "compiled", "cudagraphs")
SHAPES = {"smollm2-135m": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m"}


def build(key: str, device: str, tiny: bool, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    from fedllm.models.loading import attach_lora
    from fedllm.recipe.schema import LoraConfig

    config = AutoConfig.from_pretrained(ROOT / "fedllm" / "assets" / "configs" / SHAPES[key])
    if tiny:
        config.num_hidden_layers, config.vocab_size = 2, 1024
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device)
    model = attach_lora(base, LoraConfig(r=8, alpha=16, init="gaussian"), "causal_lm")
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model, config.vocab_size


class Variant:
    """One model + optimizer trained with one variant's settings."""

    def __init__(self, name: str, key: str, device: str, tiny: bool, batch: dict, cfg):
        from fedllm.engine.client import lora_input_casts_skipped, training_attention

        self.name, self.batch, self.cfg, self.device = name, batch, cfg, device
        self.model, _ = build(key, device, tiny)
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = name != "eager" and device == "cuda"
        self.opt = torch.optim.AdamW(params, lr=1e-4, fused=fused or None, foreach=None if fused else True)
        self.contexts = [training_attention(self.model, cfg), lora_input_casts_skipped(self.model, cfg)]
        for c in self.contexts:
            c.__enter__()
        if name in ("compiled", "cudagraphs"):
            mode = "reduce-overhead" if name == "cudagraphs" else None
            for layer in self.model.get_base_model().model.layers:
                layer.compile(dynamic=False, mode=mode)
        self.loss = float("nan")

    def step(self) -> None:
        from fedllm.engine.client import micro_batch_loss, train_autocast

        if self.name == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()
        with train_autocast(torch.device(self.device), "bf16"):
            loss = micro_batch_loss(self.model, self.batch, self.cfg)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def main(argv: list[str] | None = None) -> int:
    from fedllm.recipe.schema import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="2 layers, vocabulary 1024 (a CPU check of the code)")
    p.add_argument("--models", default=",".join(SHAPES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--shapes", default="8x128,32x512", help="comma list of BATCHxLENGTH")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = []
    for key in args.models.split(","):
        for shape in args.shapes.split(","):
            b, s = (int(x) for x in shape.split("x"))
            vocab = 1024 if args.tiny else None
            gen = torch.Generator().manual_seed(0)
            if vocab is None:
                from transformers import AutoConfig

                vocab = AutoConfig.from_pretrained(ROOT / "fedllm" / "assets" / "configs" / SHAPES[key]).vocab_size
            ids = torch.randint(10, vocab, (b, s), generator=gen)
            labels = ids.clone()
            labels[:, : s - s // 4] = -100  # a quarter of the positions carry the loss
            batch = {k: v.to(args.device) for k, v in
                     {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}.items()}
            cfg = TrainConfig(dtype="bf16", max_length=s, local_steps=1)
            variants, warmups = [], {}
            for name in args.variants.split(","):
                if name == "cudagraphs" and not cuda:
                    continue
                v = Variant(name, key, args.device, args.tiny, batch, cfg)
                sync()
                t0 = time.perf_counter()
                for _ in range(3):
                    v.step()
                sync()
                warmups[name] = time.perf_counter() - t0
                variants.append(v)
            times: dict[str, list[float]] = {v.name: [] for v in variants}
            for _ in range(args.trials):
                for v in variants:
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        v.step()
                    sync()
                    times[v.name].append((time.perf_counter() - t0) / args.steps)
            eager = min(times["eager"]) if "eager" in times else None
            for v in variants:
                best = min(times[v.name])
                row = {"model": key, "shape": shape, "variant": v.name, "seconds_per_step": best,
                       "trials": times[v.name], "warmup_3_steps_s": warmups[v.name],
                       "speedup_vs_eager": (eager / best) if eager else None, "loss": float(v.loss)}
                results.append(row)
                print("gpu_step:", json.dumps(row), flush=True)
            for v in variants:
                for c in reversed(v.contexts):
                    c.__exit__(None, None, None)
            del variants
            if cuda:
                torch.cuda.empty_cache()
            torch._dynamo.reset()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0) if cuda else "cpu",
                                               "torch": torch.__version__, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
