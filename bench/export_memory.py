"""Peak memory of a FRLoRA run's merged export against the training run's, per phase (issue #48 item 4).

A LLaMA-2-7B-shaped model cut to a few decoder layers (the shipped config, seeded random bf16 weights, fedllm's tiny
tokenizer), FRLoRA with a dense fp32 residual beside the bf16 base (``residual: auto``), one round of one client x 1
step at 1 x 256 with checkpointing, then ``fedllm export RUN --format merged``. Each runs in a fresh subprocess, and
each figure is that process's peak RSS minus its idle baseline (RSS after its imports). The export's phases are
traced by wrapping the functions it calls; each phase's peak is the kernel's ``VmHWM``, reset at the phase's start
through ``/proc/self/clear_refs`` (Linux). Beside it, the peak of anonymous memory (``RssAnon``, sampled every
2 ms): ``VmHWM`` also counts the memory-mapped base's file pages, which the kernel drops and reads back under
memory pressure from other processes, so on a shared machine it depends on the neighbours; anonymous memory does
not (:class:`AnonPeak`).

    git archive ea4f381 | tar -x -C /tmp/fedllm-before      # the export before issue #48 item 4, to compare
    python bench/export_memory.py --before /tmp/fedllm-before   # 4 decoder layers of 4096 (2.1 GB bf16 base)
    python bench/export_memory.py --layers 2 --dtype fp32   # the fp32 merged export

Not a test: it needs ~8 GB of RAM and ~3 GB of disk under ``--out`` (the random weights are written once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = os.environ.get("FEDLLM_BENCH_CODE", str(ROOT))  # the fedllm a child imports (--before: an older one)
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, CODE)
GIB = 2**30


def status_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Reset ``VmHWM`` to the current RSS (``echo 5 > /proc/self/clear_refs``)."""
    Path("/proc/self/clear_refs").write_text("5")


class AnonPeak:
    """The largest ``RssAnon`` seen by a thread that reads it every 2 ms (torch's kernels release the GIL).

    ``VmHWM`` also counts the file-backed pages of the memory-mapped safetensors, which the kernel drops and reads
    back under memory pressure (on a shared machine: the figure depends on the neighbours). Anonymous memory is what
    the process cannot give back without swap (none here), so it is what decides whether the export is killed."""

    def __init__(self):
        import threading

        self.peak, self.stopped = status_bytes("RssAnon"), False
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        import time

        while not self.stopped:
            self.peak = max(self.peak, status_bytes("RssAnon"))
            time.sleep(0.002)

    def reset(self) -> int:
        """The peak so far (including now); the next one starts from now."""
        peak, self.peak = max(self.peak, status_bytes("RssAnon")), status_bytes("RssAnon")
        return peak


class Phases:
    """``mark(name)`` closes the running phase (its end RSS and peak, and its anonymous memory's, above ``idle``)
    and opens ``name``."""

    def __init__(self, idle: int, idle_anon: int):
        self.idle, self.idle_anon, self.rows, self.name = idle, idle_anon, [], None
        self.anon = AnonPeak()

    def mark(self, name: str | None) -> None:
        anon_peak = self.anon.reset()
        if self.name is not None:
            self.rows.append({"phase": self.name, "end_bytes": status_bytes("VmRSS") - self.idle,
                              "peak_bytes": status_bytes("VmHWM") - self.idle,
                              "anon_peak_bytes": anon_peak - self.idle_anon})
        self.name = name
        reset_peak()


def wrap(owner, attr: str, phases: Phases, name: str, after: str | None = None) -> None:
    """Make ``owner.attr`` open phase ``name`` when called (and phase ``after`` when it returns)."""
    original = getattr(owner, attr)

    def traced(*args, **kwargs):
        phases.mark(name)
        try:
            return original(*args, **kwargs)
        finally:
            if after is not None:
                phases.mark(after)

    setattr(owner, attr, traced)


def wrap_generator(owner, attr: str, phases: Phases, name: str, after: str) -> None:
    """Make the generator function ``owner.attr`` open phase ``name`` when called and ``after`` when exhausted."""
    original = getattr(owner, attr)

    def traced(*args, **kwargs):
        phases.mark(name)
        yield from original(*args, **kwargs)
        phases.mark(after)

    setattr(owner, attr, traced)


def random_model(layers: int, directory: Path) -> Path:
    """LLaMA-2-7B's shipped config with ``layers`` decoder layers, seeded random bf16 weights, saved once."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    from fedllm.models.loading import tiny_tokenizer

    config = transformers.AutoConfig.from_pretrained(str(ROOT / "fedllm/assets/configs/meta-llama--Llama-2-7b-hf"))
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def imports() -> None:
    """Everything both children import before their idle baseline is read."""
    import peft  # noqa: F401
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import fedllm.engine.server  # noqa: F401
    import fedllm.export  # noqa: F401
    import fedllm.export.inference  # noqa: F401
    import fedllm.strategies.frlora  # noqa: F401


def child_train(out: Path, tokens: int, base: str) -> dict:
    from real_shape import RECIPE, overrides

    from fedllm.data.synthetic import generate_arith

    records = [{**r, "question": " ".join([r["question"]] * 12)} for r in generate_arith(8)]  # past 256 tokens
    data = out / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    extra = overrides(out / "model", data, out) + ["train.local_steps=1", f"train.max_length={tokens}"]
    if base == "fp32":  # fp32 base, fp32 steps (fast on a host without native bf16), the residual kept dense as bf16's
        extra += ["model.dtype=fp32", "train.dtype=fp32",
                  "federation.strategy_args={svd: randomized, niter: 4, residual: dense}"]
    imports()
    from fedllm.engine.server import run
    from fedllm.recipe.checks import load_recipe

    recipe = load_recipe(str(RECIPE), extra)
    idle, idle_anon = status_bytes("VmRSS"), status_bytes("RssAnon")
    anon = AnonPeak()
    reset_peak()
    run(recipe)
    return {"peak_bytes": status_bytes("VmHWM") - idle, "idle_bytes": idle,
            "anon_peak_bytes": anon.reset() - idle_anon}


def child_export(out: Path, dtype: str) -> dict:
    imports()
    from fedllm.export import api, inference, merged, source
    from fedllm.runs import checkpoint
    from fedllm.strategies.frlora import FRLoRA

    idle = status_bytes("VmRSS")
    phases = Phases(idle, status_bytes("RssAnon"))
    wrap(checkpoint, "load_checkpoint", phases, "read checkpoint files", after="load model")
    wrap(FRLoRA, "setup", phases, "strategy set-up")
    wrap(checkpoint, "restore_into", phases, "restore checkpoint", after="fp32 cast (if it fits)")
    wrap(merged, "probe_logits", phases, "probe")
    if hasattr(merged, "SpilledWeights"):  # the per-layer merge as its own phase (a generator: older trees count
        wrap_generator(merged, "iter_layers", phases, "merge layers", after="unload")  # it under "unload")
    else:
        wrap(merged, "iter_layers", phases, "merge layers", after="unload")
    wrap(merged, "save_merged", phases, "save", after=None)
    del inference, source  # wrapped through the modules the export reads them from
    phases.mark("open source")
    target = out / f"merged-{dtype}-{'before' if CODE != str(ROOT) else 'after'}"
    result = api.export(out / "run", "merged", target, dtype=dtype, overwrite=True)
    phases.mark(None)
    info = result.exports[0]
    return {"phases": phases.rows, "peak_bytes": max(r["peak_bytes"] for r in phases.rows), "idle_bytes": idle,
            "anon_peak_bytes": max(r["anon_peak_bytes"] for r in phases.rows),
            "checked": info.get("checked"), "max_logit_diff": info.get("max_logit_diff"),
            "merged_dir": str(target)}


def spawn(mode: str, args: argparse.Namespace, code: Path = ROOT) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "FEDLLM_BENCH_CODE": str(code),
           "PYTHONPATH": str(code)}
    argv = ["--child", mode, "--out", args.out, "--layers", str(args.layers), "--dtype", args.dtype,
            "--tokens", str(args.tokens), "--base", args.base]
    proc = subprocess.run([sys.executable, __file__, *argv], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{mode} child failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n: int) -> str:
    return f"{n / GIB:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the LLaMA-2-7B shape (32 in the real one)")
    ap.add_argument("--tokens", type=int, default=256, help="the training step's sequence length (batch 1)")
    ap.add_argument("--base", default="bf16", choices=["bf16", "fp32"],
                    help="the run's base dtype (fp32: fp32 steps, residual: dense, as a bf16 base keeps it)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the merged export's saved dtype")
    ap.add_argument("--out", default="/tmp/fedllm_export_memory")
    ap.add_argument("--before", type=Path, help="an older fedllm tree (git archive) whose export to run first")
    ap.add_argument("--child", choices=["model", "train", "export"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out) / f"layers-{args.layers}-tokens-{args.tokens}" / args.base
    if args.child == "model":
        random_model(args.layers, out / "model")
        print("{}")
        return
    if args.child:
        found = child_train(out, args.tokens, args.base) if args.child == "train" else child_export(out, args.dtype)
        print(json.dumps(found))
        return
    args.out = str(Path(args.out))
    spawn("model", args)
    train = spawn("train", args) if not (out / "train.json").is_file() else json.loads((out / "train.json").read_text())
    (out / "train.json").write_text(json.dumps(train))
    runs = {"before": spawn("export", args, args.before)} if args.before else {}
    runs["after"] = spawn("export", args)
    print(f"LLaMA-2-7B shape, {args.layers} decoder layers, bf16 base, FRLoRA dense fp32 residual; "
          f"merged export --dtype {args.dtype}. Peak and end RSS of each phase, GiB above the process's idle RSS.")
    names = list(dict.fromkeys(r["phase"] for found in runs.values() for r in found["phases"]))
    columns = (("peak_bytes", " peak", 13), ("end_bytes", " end", 11), ("anon_peak_bytes", " anon", 11))
    print(f"{'phase':<26}" + "".join(f"{k + suffix:>{w}}" for k in runs for _, suffix, w in columns))
    for name in names:
        cells = ""
        for found in runs.values():
            rows = [r for r in found["phases"] if r["phase"] == name]
            cells += "".join(f"{gib(max(r.get(key, 0) for r in rows)) if rows else '-':>{w}}"
                             for key, _, w in columns)
        print(f"{name:<26}{cells}")
    print(f"{'export peak':<26}" + "".join(f"{gib(found['peak_bytes']):>13}{'':>11}{gib(found['anon_peak_bytes']):>11}"
                                           for found in runs.values()))
    print(f"{'training run peak':<26}{gib(train['peak_bytes']):>13}{'':>11}{gib(train.get('anon_peak_bytes', 0)):>11}")
    for k, found in runs.items():
        print(f"{k}: export {gib(found['peak_bytes'])} GiB RSS ({gib(found['anon_peak_bytes'])} anonymous), "
              f"{gib(train['peak_bytes'] - found['peak_bytes'])} GiB below the training run's peak RSS "
              f"({gib(train.get('anon_peak_bytes', 0) - found['anon_peak_bytes'])} anonymous); probe "
              f"{'held to fp32 tolerance' if found['checked'] else 'reported'} "
              f"(largest logit difference {found['max_logit_diff']:.3g})")
    if len(runs) == 2:
        a, b = (Path(found["merged_dir"]) for found in (runs["before"], runs["after"]))
        print("merged files equal bit for bit:", same_files(a, b))
    print(json.dumps({"train": train, **runs}))


def same_files(a: Path, b: Path) -> bool:
    """Whether two merged exports hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    names = sorted(p.name for p in a.glob("*.safetensors"))
    if names != sorted(p.name for p in b.glob("*.safetensors")):
        return False
    for name in names:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        if x.keys() != y.keys() or not all(torch_equal(x[k], y[k]) for k in x):
            return False
    return True


def torch_equal(x, y) -> bool:
    import torch

    return x.dtype == y.dtype and torch.equal(x, y)

if __name__ == "__main__":
    main()
