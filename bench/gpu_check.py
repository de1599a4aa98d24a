"""One-call GPU acceptance check: federated LoRA rounds on real model shapes, with speed, MFU and memory.

    python bench/gpu_check.py                                  # on the GPU (cuda): bf16, 4bit, fp32
    python bench/gpu_check.py --device cpu --configs fp32 --save-ref REF.json   # the CPU reference losses
    python bench/gpu_check.py --big --ref REF.json --json OUT.json   # GPU, losses beside the CPU reference
    python bench/gpu_check.py --dry                            # seconds on a CPU: the same code, tiny shapes
    python bench/gpu_check.py --paper-7b --configs bf16 --checkpointing true,2   # 7B: all layers vs every 2nd
    python bench/gpu_check.py --device cuda --paper-7b --compile false,true --estimate-only   # no GPU: estimates

docs/gpu.md has the command, the figures of a run on an H200 and what this check does not cover.

Models: SmolLM2-135M and Gemma 3 270M *shapes*, built from the configs fedllm ships
(``fedllm/assets/configs/<preset>/config.json``) with seeded random weights (normal, std =
``initializer_range``, one CPU generator per tensor, so every machine builds the same weights; a
fingerprint of them is stored with the CPU reference and checked against it). Each model is written
once to a local directory (safetensors, with fedllm's small tokenizer) and every run loads it through
fedllm's own loader (``model.name`` = that directory), so ``model.quantization: 4bit`` goes through
transformers + bitsandbytes as for real weights. Tokens/s, FLOP/s, MFU and memory do not depend on the
weights' values; the losses of random weights are a sanity check (GPU against CPU), not a quality figure.

Configurations (``--configs``): ``fp32`` (model and compute fp32; on the GPU this is the tight match
with the CPU reference), ``bf16`` (``model.dtype: bf16``, ``train.dtype: bf16``), ``4bit`` (QLoRA:
``model.quantization: 4bit``, NF4 + double quantisation, bf16 compute), ``8bit`` (``model.quantization: 8bit``,
LLM.int8(), bf16 compute: the FRLoRA LLaMA-2-7B recipe's base; not in the default list); strategies FedAvg and FRLoRA
(exact SVD init); 4 clients, 2 per round, 2 rounds, LoRA r=8 on q/k/v/o, batch 8 x 128 tokens,
4 local steps. Every example is exactly ``max_length`` tokens (long few-shot arithmetic prompts,
left-truncated by fedllm), so no position is padding. ``--big`` adds bf16 and 4bit FedAvg rows at
batch 32 x 512 tokens (speed only: no CPU reference).

Per configuration it prints (and writes to ``--json``):

- training tokens/s: non-padding tokens of the clients' micro-batches over the seconds of
  ``LocalExecutor.train`` (every sampled client's local training of a round, device synchronised
  before and after), for each round; round 1 holds the warm-up (kernel selection, cuBLAS handles), so
  the speed figures are round 2's;
- achieved FLOP/s and MFU: model FLOPs of the micro-batches actually trained (:func:`step_flops`: frozen
  linear layers forward + input gradient, LoRA forward + both gradients, attention ``12·b·S²·d_q``
  per layer (no causal halving, no recomputation), the LM head at the supervised positions only, as
  ``train.loss_positions: supervised`` runs it) over the same seconds, against the card's dense peak
  (spec-sheet table :data:`fedllm.models.hardware.SPEC_PEAKS`, bf16 for bf16/4bit runs, fp32 non-tensor for fp32
  runs) and against a measured 8192^3 bf16 matmul (:func:`matmul_probe`); on a CPU (``--device cpu``, ``--dry``)
  against fedllm's own probe of the model's matmul shapes in the run's dtype
  (:func:`fedllm.models.hardware.device_peak`, as every ``fedllm train`` reports MFU);
- peak GPU memory (``torch.cuda.max_memory_allocated`` from loading to the end of the run) next to the
  peak-memory estimate of ``fedllm train --dry-run`` (:func:`fedllm.commands.dry_run.untimed`);
- per-round train losses next to the CPU reference's (``--ref``, written by ``--save-ref`` with
  ``--device cpu --configs fp32``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # python bench/gpu_check.py from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fedllm.engine.server import LocalExecutor  # noqa: E402
from fedllm.models.flops import FlopShapes as Shapes  # noqa: E402
from fedllm.models.flops import step_flops  # noqa: E402
from fedllm.models.hardware import device_peak, spec_peak  # noqa: E402

#: Model shapes checked: name -> fedllm's shipped config directory (fedllm/assets/configs/<dir>).
MODELS = {"smollm2-135m": "smollm2-135m-instruct", "gemma3-270m": "gemma3-270m",
          "llama2-7b": "meta-llama--Llama-2-7b-hf"}
#: Configuration -> (model.dtype, model.quantization, train.dtype).
CONFIGS = {"fp32": ("fp32", "none", "fp32"), "bf16": ("bf16", "none", "bf16"), "4bit": ("bf16", "4bit", "bf16"),
           "8bit": ("bf16", "8bit", "bf16")}
#: Strategy -> strategy_args.
STRATEGIES = {"fedavg": {}, "frlora": {"svd": "exact"}}
#: ``--paper-7b``: the LoRA and FRLoRA settings of recipes/frlora/llama2-7b-metamathqa-frlora.yaml.
PAPER_LORA = {"r": 32, "alpha": 64, "target_modules": ["q_proj", "v_proj"]}
PAPER_STRATEGIES = {"fedavg": {}, "frlora": {"svd": "randomized", "niter": 4, "residual": "auto"}}
IGNORE = -100


# --------------------------------------------------------------------------- workload


def workload(args: argparse.Namespace, big: bool = False) -> dict[str, int]:
    """Clients, rounds, steps and batch shape of a run (``--dry``: tiny; ``big``: the throughput rows)."""
    paper = dict(lora=PAPER_LORA, strategies=PAPER_STRATEGIES) if args.paper_7b else {}
    if args.dry:
        return dict(num_clients=4, per_round=2, rounds=2, steps=1, batch=2, max_length=48,
                    r=PAPER_LORA["r"] if paper else 4, **paper)
    if args.paper_7b:  # issue 48 item 6: the paper's batch and length, checkpointing, 1 client a round
        return dict(num_clients=2, per_round=1, rounds=2, steps=args.steps, batch=16, max_length=512,
                    r=PAPER_LORA["r"], **paper)
    if big:
        return dict(num_clients=4, per_round=2, rounds=2, steps=4, batch=32, max_length=512, r=8)
    return dict(num_clients=4, per_round=2, rounds=2, steps=args.steps, batch=args.batch,
                max_length=args.max_length, r=8)


def row_workload(args: argparse.Namespace, big: bool, compiled: str, kept: str) -> dict[str, Any]:
    """:func:`workload` with a row's ``--compile`` and ``--checkpointing`` items as recipe values."""
    return {**workload(args, big), "compile": {"false": False, "true": True}.get(compiled, compiled),
            "checkpointing": checkpointing_setting(kept)}


def write_data(path: Path, n: int, shots: int = 14, seed: int = 0) -> Path:
    """``n`` arithmetic problems behind ``shots`` solved ones (far longer than any max_length used here, so
    fedllm left-truncates every prompt and each example is exactly ``max_length`` tokens)."""
    from fedllm.data.synthetic import generate_arith

    rng = random.Random(seed)
    pool = generate_arith(n + 200, seed=seed)
    lines = []
    for rec in pool[:n]:
        context = "".join(f"Q: {s['question']}\nA: {s['answer']}\n\n" for s in rng.sample(pool[n:], shots))
        lines.append(json.dumps({"question": context + "Q: " + rec["question"], "answer": rec["answer"]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def model_config(key: str, dry: bool) -> Any:
    """The transformers config of model ``key`` from fedllm's shipped copy (``dry``: 2 layers, vocab 1024)."""
    import transformers

    from fedllm.models.info import CONFIGS_DIR

    config = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / MODELS[key]))
    if dry:
        config.num_hidden_layers = 2
        config.vocab_size = 1024
        if key == "llama2-7b":  # 2 layers of 4096 would still be 0.8 B parameters
            config.hidden_size, config.intermediate_size = 256, 688
            config.num_attention_heads = config.num_key_value_heads = 4
        if getattr(config, "layer_types", None):
            config.layer_types = ["sliding_attention", "full_attention"]
    return config


def fill_weights(model: torch.nn.Module, std: float, seed: int = 0) -> None:
    """Every matrix ~ N(0, std²) from its own CPU generator (seed + crc32 of its name): the same weights on any
    machine and library version; 1-D tensors (norms) keep the values ``from_config`` gives them (constants)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def fingerprint(model: torch.nn.Module) -> list[float]:
    """``[sum, sum of squares]`` of every parameter in fp64: equal weights give equal fingerprints."""
    total, squares = 0.0, 0.0
    for _, p in sorted(model.named_parameters()):
        x = p.detach().double()
        total += float(x.sum())
        squares += float((x * x).sum())
    return [total, squares]


def same_weights(a: list[float], b: list[float]) -> bool:
    """Equal fingerprints up to the rounding of a float64 sum taken in another order (threads, library)."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-6) for x, y in zip(a, b))


def build_model_dir(key: str, where: Path, dry: bool, on_device: Optional[str] = None) -> tuple[Path, list[float]]:
    """Write model ``key`` (random weights, fp32 safetensors) and fedllm's tiny tokenizer to ``where``.

    ``on_device``: transformers' own random init made on that device, saved in bf16, no fingerprint (the 7B shape in
    seconds on a GPU, where a CPU generator per tensor would take minutes; its weights meet no CPU reference)."""
    import transformers

    from fedllm.models.loading import tiny_tokenizer

    config = model_config(key, dry)
    torch.manual_seed(0)
    with torch.device(on_device or "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16 if on_device else torch.float32)
    prints: list[float] = []
    if not on_device:
        fill_weights(model, getattr(config, "initializer_range", 0.02))
        prints = fingerprint(model)
    model.save_pretrained(str(where))
    tiny_tokenizer().save_pretrained(str(where))
    del model
    gc.collect()
    if on_device == "cuda":
        torch.cuda.empty_cache()
    return where, prints


def recipe_for(model_dir: Path, data: Path, out: Path, strategy: str, config: str, device: str,
               w: dict[str, int]) -> Any:
    """The recipe of one run (``fedllm.recipe.checks.parse_recipe``)."""
    from fedllm.recipe.checks import parse_recipe

    model_dtype, quant, train_dtype = CONFIGS[config]
    lora = w.get("lora") or {"r": w["r"], "alpha": 2 * w["r"],
                             "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
    return parse_recipe({
        "seed": 0, "output_dir": str(out),
        "model": {"name": str(model_dir), "dtype": model_dtype, "quantization": quant,
                  "device_map": "cuda" if device == "cuda" else None},
        "lora": dict(lora),
        "data": {"path": str(data), "format": "instruction", "cache": False,
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": w["num_clients"], "clients_per_round": w["per_round"], "rounds": w["rounds"],
                       "strategy": strategy, "strategy_args": dict(w.get("strategies", STRATEGIES)[strategy]),
                       "partition": {"method": "iid"}},
        "train": {"local_steps": w["steps"], "batch_size": w["batch"], "max_length": w["max_length"],
                  "lr": 1.0e-3, "dtype": train_dtype, "compile": w.get("compile", False),
                  "gradient_checkpointing": w.get("checkpointing", False)},
        "logging": {"progress": False, "quiet": True},
    }, source=f"<gpu_check {model_dir.name} {config} {strategy}>")


# --------------------------------------------------------------------------- FLOPs


def counted_flops(model: Any, batch: dict[str, torch.Tensor], train_cfg: Any) -> float:
    """FLOPs of one micro-batch's forward + backward as ``torch.utils.flop_counter`` counts them (SDPA's math
    backend, so that attention is counted on the CPU too): the check of :func:`step_flops`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from fedllm.engine.client import micro_batch_loss

    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        micro_batch_loss(model, batch, train_cfg).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


# --------------------------------------------------------------------------- timing


class TimedExecutor(LocalExecutor):
    """fedllm's in-process executor, timing each round's client training and recording its micro-batches."""

    def __init__(self, synchronize: Callable[[], None], profile_round: Optional[int] = None,
                 profile_path: Optional[Path] = None):
        super().__init__()
        self.synchronize = synchronize
        self.profile_round, self.profile_path = profile_round, profile_path
        self.rounds: list[dict[str, Any]] = []
        self.batches: list[tuple[int, int, int, int]] = []  # (batch, length, real tokens, supervised positions)
        self.first_batch: Optional[dict[str, torch.Tensor]] = None

    def _recording(self, collate: Callable[[list[dict]], dict]) -> Callable[[list[dict]], dict]:
        def collate_and_record(items: list[dict]) -> dict:
            batch = collate(items)
            ids = batch["input_ids"]
            supervised = int((batch["labels"][:, 1:] != IGNORE).sum())
            self.batches.append((ids.shape[0], ids.shape[1], int(batch["attention_mask"].sum()), supervised))
            if self.first_batch is None:
                self.first_batch = {k: v.clone() for k, v in batch.items()}
            return batch

        collate_and_record.recording = True  # type: ignore[attr-defined]
        return collate_and_record

    def train(self, loop: Any, rnd: int, sampled: list[int], lr: float, bar: Any):
        if not getattr(loop.collate, "recording", False):
            loop.collate = self._recording(loop.collate)
        start = len(self.batches)
        if rnd == self.profile_round and self.profile_path is not None:
            return self._profiled(loop, rnd, sampled, lr, bar)
        self.synchronize()
        t0 = time.perf_counter()
        out = super().train(loop, rnd, sampled, lr, bar)
        self.synchronize()
        self.rounds.append({"round": rnd, "seconds": time.perf_counter() - t0, "batches": self.batches[start:]})
        return out


    def _profiled(self, loop: Any, rnd: int, sampled: list[int], lr: float, bar: Any):
        """This round under torch.profiler (host ops, kernels) and cProfile (Python): its two summaries, written
        to ``profile_path``; the round is still timed (the profilers' own cost included, so read its speed apart)."""
        import cProfile
        import io
        import pstats

        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        python = cProfile.Profile()
        start = len(self.batches)
        self.synchronize()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            python.enable()
            out = super().train(loop, rnd, sampled, lr, bar)
            python.disable()
            self.synchronize()
        seconds = time.perf_counter() - t0
        self.rounds.append({"round": rnd, "seconds": seconds, "batches": self.batches[start:], "profiled": True})
        events = prof.key_averages()
        kernels = sum(e.count for e in events if getattr(e, "device_type", None) is not None
                      and "CUDA" in str(e.device_type))
        text = io.StringIO()
        stats = pstats.Stats(python, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats(60)
        self.profile_path.write_text(
            f"round {rnd}: {len(self.batches) - start} micro-batches in {seconds:.3f} s under both profilers; "
            f"device-side events: {kernels}\n\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60) + "\n\n"
            + (events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60) + "\n\n"
               if torch.cuda.is_available() else "")
            + text.getvalue())
        return out


def matmul_probe(device: str, n: int = 8192, warmup: int = 3, timed: int = 10) -> Optional[float]:
    """bf16 ``n x n x n`` matmul FLOP/s on random data (mean of ``timed`` after ``warmup``; CUDA events)."""
    if device != "cuda":
        return None
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(warmup):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(timed):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / timed
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / seconds


# --------------------------------------------------------------------------- one run


def memory_estimate(recipe: Any, device: Optional[str] = None) -> Optional[int]:
    """Bytes of ``fedllm train --dry-run``'s peak-memory estimate (the model built on the meta device) for training on
    ``device`` (default: where the dry run would train)."""
    from fedllm.commands.dry_run import untimed

    report = untimed(recipe, weights_missing="gpu_check: estimate only")
    return int(sum(report.costs.memory(device).values()))


def print_estimates(plan: list[tuple], args: argparse.Namespace, work: Path, data: Path) -> int:
    """``--estimate-only``: each planned row's dry-run estimate for ``--device``, from the model's config and
    fedllm's tiny tokenizer alone (no weights, no training: a CPU host gives a GPU row's estimate)."""
    from fedllm.models.loading import tiny_tokenizer

    for key, config, strategy, big, compiled, kept in plan:
        where = work / f"config-{key}"
        if not where.exists():
            where.mkdir(parents=True)
            model_config(key, args.dry).to_json_file(str(where / "config.json"))
            tiny_tokenizer().save_pretrained(str(where))
        w = row_workload(args, big, compiled, kept)
        recipe = recipe_for(where, data, work / "estimate", strategy, config, args.device, w)
        print(f"gpu_check: estimate {key} {config} {strategy} {w['batch']} x {w['max_length']} compile={w['compile']} "
              f"checkpointing={w['checkpointing']}: {_gb(memory_estimate(recipe, args.device))} GiB "
              f"({args.device})", flush=True)
    return 0


def run_one(key: str, model_dir: Path, data: Path, out: Path, strategy: str, config: str, device: str,
            w: dict[str, int], shapes: Shapes, check_flops: bool = False,
            profile_path: Optional[Path] = None) -> dict[str, Any]:
    """One federated run through ``fedllm.engine.server.run`` with :class:`TimedExecutor`; its figures."""
    from fedllm.engine.server import run

    recipe = recipe_for(model_dir, data, out, strategy, config, device, w)
    row: dict[str, Any] = {"model": key, "config": config, "strategy": strategy, "batch": w["batch"],
                           "max_length": w["max_length"], "local_steps": w["steps"], "rounds": w["rounds"]}
    try:
        row["memory_estimate"] = memory_estimate(recipe)
    except Exception as e:  # noqa: BLE001 — the estimate is a side figure; the run goes on
        row["memory_estimate_error"] = f"{type(e).__name__}: {e}"
    cuda = device == "cuda"
    if not cuda:  # fedllm's CPU peak: a probe of this model's matmul shapes in the run's compute dtype
        peak = device_peak(torch.device("cpu"), "fp32" if config == "fp32" else "bf16", list(shapes.weights),
                           w["batch"] * w["max_length"])
        row["peak_probe"] = peak.flops_per_s if peak else None
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base_allocated = torch.cuda.memory_allocated()
    executor = TimedExecutor(torch.cuda.synchronize if cuda else (lambda: None),
                             profile_round=w["rounds"] if profile_path else None, profile_path=profile_path)
    t0 = time.perf_counter()
    result = run(recipe, overwrite=True, progress=False, executor=executor)  # a --work-dir used before
    row["wall_seconds"] = round(time.perf_counter() - t0, 2)
    if cuda:
        row["peak_allocated"] = torch.cuda.max_memory_allocated() - base_allocated
        row["peak_reserved"] = torch.cuda.max_memory_reserved()
    residual = getattr(getattr(result.strategy, "base", None), "mode", None) == "dense"  # FRLoRA's hooked residual
    row["dense_residual"] = residual
    rounds = [h for h in result.history if h.get("round", 0) > 0]
    row["losses"] = [h["train_loss"] for h in rounds]
    row["dropped"] = {str(h["round"]): h["dropped"] for h in rounds if h.get("dropped")}
    row["rounds_detail"] = []
    for timed in executor.rounds:
        tokens = sum(b[2] for b in timed["batches"])
        positions = sum(b[0] * b[1] for b in timed["batches"])
        flops = sum(step_flops(shapes, b[0], b[1], b[3], residual) for b in timed["batches"])
        row["rounds_detail"].append({"round": timed["round"], "seconds": round(timed["seconds"], 4),
                                     "micro_batches": len(timed["batches"]), "tokens": tokens,
                                     "padded_positions": positions - tokens, "flops": flops,
                                     "tokens_per_s": tokens / timed["seconds"],
                                     "flops_per_s": flops / timed["seconds"]})
    if check_flops and executor.first_batch is not None:
        batch = {k: v.to(next(result.model.parameters()).device) for k, v in executor.first_batch.items()}
        b, s = batch["input_ids"].shape
        sup = int((batch["labels"][:, 1:] != IGNORE).sum())
        result.model.train()
        counted = counted_flops(result.model, batch, recipe.train)
        row["flop_check"] = {"formula": step_flops(shapes, b, s, sup, residual), "flop_counter": counted}
    del result
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        row["allocated_after"] = torch.cuda.memory_allocated() - base_allocated  # a leak between runs shows here
    return row


# --------------------------------------------------------------------------- report


def _gb(n: Optional[float]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def summarise(row: dict[str, Any], peaks: dict[str, Optional[float]], ref: dict[str, Any]) -> dict[str, Any]:
    """Add the steady-state figures (last round), MFU and the CPU reference to ``row``."""
    if "rounds_detail" not in row or not row["rounds_detail"]:
        return row
    last = row["rounds_detail"][-1]
    row["tokens_per_s"] = last["tokens_per_s"]
    row["flops_per_s"] = last["flops_per_s"]
    dtype = "fp32" if row["config"] == "fp32" else "bf16"
    spec = peaks.get(f"spec_{dtype}")
    row["mfu_spec"] = last["flops_per_s"] / spec if spec else None
    probe = row.get("peak_probe") or (peaks.get("probe_bf16") if dtype == "bf16" else None)
    row["mfu_probe"] = last["flops_per_s"] / probe if probe else None
    key = f"{row['model']}/{row['strategy']}/b{row['batch']}x{row['max_length']}"
    cpu = ref.get("runs", {}).get(key)
    if cpu is not None:
        row["cpu_losses"] = cpu["losses"]
        row["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(row["losses"], cpu["losses"]))
    return row


def print_table(rows: list[dict[str, Any]], out: Any = None) -> None:
    out = out or sys.stdout  # read now, not at import (a caller may have redirected it since)
    head = (f"{'model':<13} {'config':<5} {'strategy':<7} {'compile':<10} {'ckpt':<5} {'b x S':>7} {'tok/s r1':>9} "
            f"{'tok/s r2':>9} {'TFLOP/s':>8} {'MFU spec':>8} {'MFU probe':>9} {'peak GiB':>8} {'est GiB':>7} "
            f"{'loss r1, r2':>17} {'CPU fp32 r1, r2':>17} {'max |d|':>8}")
    print(head, file=out)
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<13} {r['config']:<5} {r['strategy']:<7} {str(r.get('compile', False)):<10} "
                  f"{str(r.get('checkpointing', False)):<5} "
                  f"FAILED: {r['error']}", file=out)
            continue
        d = r["rounds_detail"]
        pct = lambda x: "-" if x is None else f"{100 * x:.2f}%"  # noqa: E731
        losses = ", ".join(f"{x:.4f}" for x in r["losses"])
        cpu = ", ".join(f"{x:.4f}" for x in r.get("cpu_losses", [])) or "-"
        diff = f"{r['max_abs_loss_diff']:.1e}" if "max_abs_loss_diff" in r else "-"
        print(f"{r['model']:<13} {r['config']:<5} {r['strategy']:<7} {str(r.get('compile', False)):<10} "
              f"{str(r.get('checkpointing', False)):<5} "
              f"{r['batch']:>3}x{r['max_length']:<3} "
              f"{d[0]['tokens_per_s']:>9,.0f} {d[-1]['tokens_per_s']:>9,.0f} {r['flops_per_s'] / 1e12:>8.2f} "
              f"{pct(r.get('mfu_spec')):>8} {pct(r.get('mfu_probe')):>9} {_gb(r.get('peak_allocated')):>8} "
              f"{_gb(r.get('memory_estimate')):>7} {losses:>17} {cpu:>17} {diff:>8}", file=out)


# --------------------------------------------------------------------------- main


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dry", action="store_true", help="CPU, tiny shapes (2 layers, vocab 1024), 1 step: seconds")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--configs", default=None, help="comma list of fp32, bf16, 4bit, 8bit (default: bf16,4bit,fp32 "
                                                   "on cuda; fp32 on cpu; fp32,bf16 with --dry; 4bit and 8bit "
                                                   "on a CPU need bitsandbytes' CPU backend)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma list of fedavg, frlora")
    p.add_argument("--steps", type=int, default=4, help="local steps per client per round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--big", action="store_true", help="add bf16 and 4bit FedAvg rows at batch 32 x 512 (speed only)")
    p.add_argument("--ref", default=None, help="CPU reference JSON (from --save-ref) to put the losses beside")
    p.add_argument("--save-ref", default=None, help="write this run's losses as the CPU reference JSON")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--budget-s", type=float, default=330.0, help="start no further run after this many seconds")
    p.add_argument("--profile", default=None, help="profile the last round of the first run (torch.profiler and "
                                                   "cProfile summaries to this file) and stop after that run")
    p.add_argument("--compile", default="false", help="train.compile of the runs: a comma list of false, true, "
                                                     "cudagraphs; each row runs once per setting")
    p.add_argument("--checkpointing", default=None,
                   help="train.gradient_checkpointing of the runs: a comma list of false, true and integers k >= 2 "
                        "(every k-th decoder layer: less recompute, more memory); each row runs once per setting "
                        "(default: true with --paper-7b, else false)")
    p.add_argument("--paper-7b", action="store_true",
                   help="issue 48 item 6: the LLaMA-2-7B shape (random weights made on the device) at the paper's "
                        "batch 16 x 512 with gradient checkpointing, LoRA and FRLoRA as "
                        "recipes/frlora/llama2-7b-metamathqa-frlora.yaml (r=32 on q/v, randomized SVD), 2 clients, "
                        "1 a round, 2 rounds of --steps steps; configs bf16,4bit (8bit: the recipe's own base), "
                        "strategies fedavg,frlora")
    p.add_argument("--work-dir", default=None, help="where models, data and run directories go (default: a temp dir)")
    p.add_argument("--estimate-only", action="store_true",
                   help="print each row's dry-run peak-memory estimate for --device and train nothing (no GPU "
                        "needed: the model is built on the meta device from its config)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cpu" if args.dry or not torch.cuda.is_available() else "cuda"
    if args.dry:
        args.device = "cpu"
    if args.paper_7b:
        args.models = "llama2-7b"
        args.configs = args.configs or "bf16,4bit"
    if args.configs is None:
        args.configs = "fp32,bf16" if args.dry else ("bf16,4bit,fp32" if args.device == "cuda" else "fp32")
    if args.checkpointing is None:
        args.checkpointing = "true" if args.paper_7b else "false"
    return args


def checkpointing_setting(text: str) -> bool | int | None:
    """``--checkpointing`` item -> ``train.gradient_checkpointing`` (None: not a setting)."""
    if text in ("false", "true"):
        return text == "true"
    return int(text) if text.isascii() and text.isdigit() and int(text) >= 2 else None


def environment(device: str) -> dict[str, Any]:
    import peft
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "peft": peft.__version__, "device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    try:
        import bitsandbytes

        env["bitsandbytes"] = bitsandbytes.__version__
    except Exception as e:  # noqa: BLE001 — 4bit rows are skipped without it
        env["bitsandbytes"] = f"unavailable ({type(e).__name__}: {e})"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=torch.cuda.get_device_name(0), gpu_memory=props.total_memory, sms=props.multi_processor_count,
                   cuda=torch.version.cuda)
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available() and not args.estimate_only:
        print("gpu_check: --device cuda but torch sees no GPU", file=sys.stderr)
        return 2
    env = environment(args.device if torch.cuda.is_available() or args.device == "cpu" else "cpu")
    print("gpu_check:", json.dumps(env))
    models = [m for m in args.models.split(",") if m]
    configs = [c for c in args.configs.split(",") if c]
    strategies = [s for s in args.strategies.split(",") if s]
    compiles = [c for c in args.compile.split(",") if c]
    checkpointings = [c for c in args.checkpointing.split(",") if c]
    for name, given, known in (("model", models, MODELS), ("config", configs, CONFIGS),
                               ("strategy", strategies, STRATEGIES),
                               ("compile setting", compiles, ("false", "true", "cudagraphs"))):
        bad = [x for x in given if x not in known]
        if bad:
            print(f"gpu_check: unknown {name}(s) {bad}; known: {', '.join(known)}", file=sys.stderr)
            return 2
    bad = [x for x in checkpointings if checkpointing_setting(x) is None]
    if bad:
        print(f"gpu_check: unknown checkpointing setting(s) {bad}; known: false, true, an integer k >= 2",
              file=sys.stderr)
        return 2
    skipped: list[str] = []
    for quantized in [c for c in configs if CONFIGS[c][1] != "none" and not env["bitsandbytes"][0].isdigit()]:
        configs.remove(quantized)
        skipped.append(f"{quantized}: needs bitsandbytes ({env['bitsandbytes']})")
    ref = json.loads(Path(args.ref).read_text()) if args.ref else {}

    peaks: dict[str, Optional[float]] = {"spec_bf16": None, "spec_fp32": None, "probe_bf16": None}
    if args.device == "cuda" and not args.estimate_only:
        peaks.update(spec_bf16=spec_peak(env["gpu"], "bf16"), spec_fp32=spec_peak(env["gpu"], "fp32"),
                     probe_bf16=matmul_probe("cuda"))
        print(f"gpu_check: {env['gpu']}: spec dense bf16 {peaks['spec_bf16'] or 0:.3g} FLOP/s, fp32 "
              f"{peaks['spec_fp32'] or 0:.3g}; measured 8192^3 bf16 matmul {peaks['probe_bf16']:.4g} FLOP/s")

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work / "data.jsonl", 64)  # 16 records a client
    # a client holds whole batches of 32 (--big), or 3 steps of 16 (--paper-7b: 2 clients)
    data_big = write_data(work / "data-big.jsonl", 256) if args.big or args.paper_7b else data
    plan = [(m, c, s, False, k, g) for k in compiles for g in checkpointings for c in configs for m in models
            for s in strategies]  # bf16 first
    if args.big and not args.dry and args.device == "cuda":
        plan += [(m, c, "fedavg", True, k, g) for k in compiles for g in checkpointings for m in models
                 for c in ("bf16", "4bit") if c in configs]
    if args.estimate_only:
        return print_estimates(plan, args, work, data_big if args.big or args.paper_7b else data)
    rows: list[dict[str, Any]] = []
    built: dict[str, tuple[Path, list[float], Shapes]] = {}
    for i, (key, config, strategy, big, compiled, kept) in enumerate(plan):
        elapsed = time.perf_counter() - t_start
        if elapsed > args.budget_s:
            skipped += [f"{k} {c} {s}{' big' if b else ''} compile={m} checkpointing={g}: over --budget-s "
                        f"{args.budget_s:g}" for k, c, s, b, m, g in plan[i:]]
            break
        w = row_workload(args, big, compiled, kept)
        row: dict[str, Any] = {"model": key, "config": config, "strategy": strategy, "batch": w["batch"],
                               "max_length": w["max_length"], "compile": w["compile"],
                               "checkpointing": w["checkpointing"]}
        try:
            if key not in built:
                t0 = time.perf_counter()
                on_device = args.device if args.paper_7b and not args.dry else None
                where, prints = build_model_dir(key, work / f"model-{key}", args.dry, on_device)
                config_dict = json.loads((where / "config.json").read_text())
                targets = (w.get("lora") or {}).get("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj"])
                built[key] = (where, prints, Shapes.of(config_dict, w["r"], targets))
                print(f"gpu_check: built {key} ({sum(1 for _ in where.iterdir())} files) in "
                      f"{time.perf_counter() - t0:.1f} s; fingerprint {prints}")
            where, prints, shapes = built[key]
            row = run_one(key, where, data_big if big or args.paper_7b else data, work / f"run-{i}", strategy, config,
                          args.device, w,
                          shapes, check_flops=args.dry,
                          profile_path=Path(args.profile) if args.profile and not rows else None)
            row["fingerprint"] = prints
            ref_prints = ref.get("fingerprints", {}).get(key)
            if ref_prints is not None:
                row["weights_match_ref"] = same_weights(prints, ref_prints)
            summarise(row, peaks, ref if row.get("weights_match_ref", True) else {})
        except Exception as e:  # noqa: BLE001 — one broken configuration must not lose the others' figures
            traceback.print_exc()
            row["error"] = f"{type(e).__name__}: {' '.join(line.strip() for line in str(e).splitlines())[:400]}"
        rows.append(row)
        row["compile"], row["checkpointing"] = w["compile"], w["checkpointing"]
        brief = {k: row.get(k) for k in ("model", "config", "strategy", "compile", "checkpointing", "losses",
                                          "tokens_per_s", "mfu_spec", "peak_allocated", "memory_estimate",
                                          "wall_seconds", "error")}
        print("gpu_check: run", json.dumps(brief), flush=True)
        if args.json:  # after every run: a call cut off at its time limit keeps the runs that ended
            Path(args.json).write_text(json.dumps({"environment": env, "peaks": peaks, "rows": rows, "partial": True,
                                                   "argv": sys.argv[1:] if argv is None else argv}, indent=1))
        if args.profile:
            print(f"gpu_check: profile of {key} {config} {strategy}'s last round in {args.profile}")
            break

    print()
    print_table(rows)
    for s in skipped:
        print(f"skipped: {s}")
    mismatched = [k for k, (_, p, _) in built.items()
                  if ref.get("fingerprints", {}).get(k) is not None and not same_weights(p, ref["fingerprints"][k])]
    for k in mismatched:
        print(f"note: {k}'s weights differ from the CPU reference's (fingerprint): losses not compared")
    total = time.perf_counter() - t_start
    print(f"gpu_check: {len(rows)} run(s) in {total:.1f} s")
    result = {"environment": env, "peaks": peaks, "rows": rows, "skipped": skipped, "seconds": round(total, 1),
              "argv": sys.argv[1:] if argv is None else argv}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.save_ref:
        runs = {f"{r['model']}/{r['strategy']}/b{r['batch']}x{r['max_length']}": {"losses": r["losses"],
                                                                                     "config": r["config"]}
                for r in rows if "losses" in r and r["config"] == "fp32"}
        Path(args.save_ref).write_text(json.dumps({
            "environment": env, "fingerprints": {k: p for k, (_, p, _) in built.items()}, "runs": runs}, indent=1))
    failed = [r for r in rows if "error" in r or r.get("dropped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
