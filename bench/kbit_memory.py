"""Measured memory of one LoRA training step on a bf16, 8-bit and 4-bit base, with and without
``train.gradient_checkpointing`` (CPU; bitsandbytes' 4/8-bit layers run there).

Each configuration runs in a fresh process: its idle baseline is the RSS after the imports; it loads the model
(``fedllm.models.loading.load_model``, bf16 non-quantised weights), resets the kernel's peak-RSS mark
(``/proc/self/clear_refs``, 5), takes one forward + backward of the client's loss (``train.dtype: bf16`` autocast,
every position supervised) on a batch of random ids, and reports:

- ``load``: RSS after loading (every weight touched, the freed heap trimmed) minus the idle baseline: the weights as
  kept; ``load peak``: the load's own peak (bitsandbytes quantises from the bf16 weights it reads);
- ``step``: the step's peak RSS minus the RSS before it (activations, gradients, the recompute's working set);
- ``total``: the step's peak minus the idle baseline (what the step needs in all);
- the dtype of the embedding, the head and the decoder's hidden states after the load.

    python bench/kbit_memory.py                          # SmolLM2-135M at 8 x 256 and tiny shapes, every config
    python bench/kbit_memory.py --model tiny-llama --batch 4 --length 64 --bits 4bit --checkpointing
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def rss_mib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def saved(preset: str) -> str:
    """A directory holding the preset's bf16 weights and tokenizer (written once), as a bf16 hub checkpoint is (a
    preset built in code is never quantised)."""
    from safetensors.torch import save_model

    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    directory = Path(f"/tmp/fedllm_kbit_{preset}")
    if not (directory / "config.json").is_file():
        cfg = ModelConfig(name=preset, dtype="bf16")
        tok = load_tokenizer(cfg)
        model = load_base_model(cfg, tok)
        directory.mkdir(parents=True, exist_ok=True)
        model.config.__dict__.pop("quantization_config", None)  # GGUF's: the saved weights are plain bf16
        model.config.save_pretrained(directory)  # as fedllm.models.gguf_cache keeps a converted GGUF
        save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
        tok.save_pretrained(directory)
    return str(directory)


def one(model_name: str, bits: str, checkpointing: bool, batch: int, length: int, r: int) -> dict:
    """One configuration, in this process (see the module docstring)."""
    import torch

    from fedllm.engine.checkpointed import checkpointed_training
    from fedllm.engine.client import micro_batch_loss, train_autocast
    from fedllm.models.loading import load_model
    from fedllm.models.supervised_loss import base_of
    from fedllm.recipe.schema import LoraConfig, ModelConfig, TrainConfig

    torch.set_num_threads(int(os.environ.get("FEDLLM_THREADS", "2")))
    model_name = saved(model_name)  # bitsandbytes quantises what from_pretrained reads: a saved copy
    import bitsandbytes  # noqa: F401  (imported before the baseline in every configuration: its code is no weight)

    idle = rss_mib()
    loaded = load_model(ModelConfig(name=model_name, dtype="bf16", quantization=bits),
                        LoraConfig(r=r, alpha=2 * r, target_modules=["q_proj", "v_proj"]))
    model = loaded.model
    base = base_of(model)
    with torch.no_grad():  # every weight resident (safetensors maps the file: untouched pages are not in RSS yet)
        for p in model.parameters():
            p.sum()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the load freed (bf16 copies bitsandbytes quantised) goes back
    after_load = rss_mib()
    load_peak = rss_mib("VmHWM")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(loaded.tokenizer), (batch, length), generator=gen)
    hidden: dict[str, str] = {}

    def note_dtype(module, args, out) -> None:  # a middle decoder layer's output: the residual stream
        hidden.setdefault("dtype", str((out[0] if isinstance(out, tuple) else out).dtype))

    handle = base.model.layers[len(base.model.layers) // 2].register_forward_hook(note_dtype)
    cfg = TrainConfig(dtype="bf16", max_length=length, gradient_checkpointing=checkpointing, loss_positions="all")
    model.train()
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark starts again here
    before = rss_mib()
    with checkpointed_training(model, cfg), train_autocast(torch.device("cpu"), "bf16"):
        loss = micro_batch_loss(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}, cfg)
    loss.backward()
    peak = rss_mib("VmHWM")
    handle.remove()
    head = base.get_output_embeddings().weight
    return {"bits": bits, "checkpointing": checkpointing, "batch": batch, "length": length,
            "load_mib": round(after_load - idle, 1), "load_peak_mib": round(load_peak - idle, 1), "step_mib": round(peak - before, 1),
            "total_mib": round(peak - idle, 1), "embedding": str(base.get_input_embeddings().weight.dtype),
            "head": str(head.dtype), "hidden": hidden.get("dtype"), "loss": round(float(loss), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--bits")
    ap.add_argument("--checkpointing", action="store_true")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--length", type=int)
    ap.add_argument("--r", type=int, default=16)
    ap.add_argument("--configs", default="none:off,8bit:off,4bit:off,none:on,8bit:on,4bit:on")
    args = ap.parse_args()
    if args.bits:  # one configuration (the child process)
        print(json.dumps(one(args.model, args.bits, args.checkpointing, args.batch, args.length, args.r)))
        return
    shapes = [("smollm2-135m-instruct", 8, 256), ("tiny-llama", 8, 256)]
    if args.model:
        shapes = [(args.model, args.batch or 8, args.length or 256)]
    # glibc's mmap threshold fixed as bench/memory_bound.py fixes it (docs/memory.md): RSS follows the live tensors
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    configs = [(bits, ckpt == "on") for bits, ckpt in (c.split(":") for c in args.configs.split(","))]
    print("| model | b x s | base | checkpointing | weights kept (MiB) | load peak (MiB) | step peak (MiB) | total "
          "(MiB) | embedding / head / hidden | loss |")
    print("|---|---|---|---|---:|---:|---:|---:|---|---:|")
    for model_name, batch, length in shapes:
        for bits, ckpt in configs:
            cmd = [sys.executable, __file__, "--model", model_name, "--bits", bits, "--batch", str(batch),
                   "--length", str(length), "--r", str(args.r)] + (["--checkpointing"] if ckpt else [])
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            x = json.loads(out.strip().splitlines()[-1])
            print(f"| {model_name} | {batch} x {length} | {bits} | {'on' if ckpt else 'off'} | {x['load_mib']} | {x['load_peak_mib']} | "
                  f"{x['step_mib']} | {x['total_mib']} | {x['embedding'][6:]} / {x['head'][6:]} / "
                  f"{x['hidden'][6:]} | {x['loss']} |", flush=True)


if __name__ == "__main__":
    main()
