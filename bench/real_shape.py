"""The FRLoRA paper recipe at its real shape on this machine: LLaMA-2-7B from the shipped config with seeded random
bf16 weights (no download), one round of one client x 2 steps at batch 1 x 256 with activation checkpointing, then
a merged export. Not a test: it needs ~15 GB of RAM (and ~14 GB of disk for the random weights, written once).

It prints seconds per step, MFU against fedllm's probe of the host's matmul peak (``fedllm.models.hardware``, as
``bench/bf16_step.py``), the process's peak RSS above its idle baseline against the dry run's estimate of the same
recipe, and the time of FRLoRA's SVD initialisation.

    free -g                                   # run only with >= 18 GB available
    python bench/real_shape.py                # LLaMA-2-7B (meta-llama--Llama-2-7b-hf)
    python bench/real_shape.py --steps 1 --length 16   # the SVD init, checkpoint and export at their size, quickly
    python bench/real_shape.py --config smollm2-135m-instruct --out /tmp/real_shape_small   # the same path, small
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RECIPE = ROOT / "recipes/frlora/llama2-7b-metamathqa-frlora.yaml"


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def random_model(config_name: str, directory: Path) -> Path:
    """The shipped config's model with seeded random bf16 weights and fedllm's tiny tokenizer, saved once."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    import transformers

    from fedllm.models.loading import tiny_tokenizer

    config = transformers.AutoConfig.from_pretrained(str(ROOT / "fedllm/assets/configs" / config_name))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    del model
    tok = tiny_tokenizer()
    tok.save_pretrained(directory)
    return directory


def overrides(model_dir: Path, data: Path, out: Path, steps: int = 2, length: int = 256) -> list[str]:
    """The paper recipe, cut to one round of one client x ``steps`` steps at 1 x ``length`` (2 at 1 x 256: the issue's
    shape), checkpointing on, bf16 base."""
    return [f"model.name={model_dir}", "model.quantization=none", "model.dtype=bf16", f"data.path={data}",
            "data.fields.instruction=question", "data.fields.output=answer", "data.max_examples=null",
            "federation.num_clients=1", "federation.clients_per_round=1", "federation.rounds=1",
            f"train.local_steps={steps}", "train.batch_size=1", f"train.max_length={length}",
            "train.gradient_checkpointing=true",
            "eval.tasks=[]", "checkpoint.every=0", f"output_dir={out / 'run'}", "logging.progress=false"]


def dry_run_estimate(extra: list[str], config: str) -> str:
    """The dry run's peak-memory estimate of the same recipe on the meta device: the shipped config's hub id, offline,
    so the estimate comes from the shapes alone (the random model has them) without loading 13.5 GB of weights and
    timing a 7B step first."""
    hub_id = config.replace("--", "/", 1)
    meta = [f"model.name={hub_id}" if e.startswith("model.name=") else e for e in extra]
    out = subprocess.run([sys.executable, "-m", "fedllm", "train", str(RECIPE), *meta, "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    found = re.search(r"peak memory estimate[^:]*: ([0-9.,]+ [GM]B)", out)
    return found.group(1) if found else "?"


#: ``python -m fedllm ARGS`` that records its peak RSS on the way out: ``VmHWM``, the high-water mark of this process's
#: memory since its ``exec``. (Not ``ru_maxrss`` from ``wait4``: Linux folds into it the RSS the child had before its
#: ``exec``, i.e. this bench's at the fork, 17.8 GiB after a 7B round: a first run reported the training's peak as
#: the export's.)
FEDLLM_RECORDING_PEAK = """import atexit, sys
from fedllm.commands.cli import main

def record_peak(path=sys.argv[1]):
    with open('/proc/self/status') as status:
        kib = next(line.split()[1] for line in status if line.startswith('VmHWM:'))
    with open(path, 'w') as out:
        out.write(kib)

atexit.register(record_peak)
sys.exit(main(sys.argv[2:]))
"""


def export_in_a_fresh_process(run_dir: Path, where: Path) -> dict:
    """``fedllm export RUN --format merged`` as a user runs it, after the training process let its model go: its exit
    code, peak RSS (its own ``VmHWM``) and CPU seconds (from ``wait4``)."""
    peak = where.parent / f"{where.name}.peak-kib"
    child = subprocess.Popen([sys.executable, "-c", FEDLLM_RECORDING_PEAK, str(peak), "export", str(run_dir),
                              "--format", "merged", "--out", str(where)],
                             cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return {"merged_export_exit_code": child.returncode,
            "merged_export_peak_rss_gib": round(int(peak.read_text()) / 2**20, 2) if peak.is_file() else None,
            "merged_export_cpu_seconds": round(usage.ru_utime + usage.ru_stime, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="meta-llama--Llama-2-7b-hf", help="a directory of fedllm/assets/configs")
    ap.add_argument("--out", default="/tmp/fedllm_real_shape")
    ap.add_argument("--steps", type=int, default=2, help="local steps of the one client (default 2)")
    ap.add_argument("--length", type=int, default=256,
                    help="max_length of a step's one sequence (default 256). On a 2-core AVX2 host (no bf16 GEMM: "
                         "fedllm computes the bf16 products in fp32 blocks) a step at 256 took 133 s and the whole "
                         "bench 17 minutes; the SVD init, the checkpoint and the merged export do not depend on the "
                         "step's shape (--steps 1 --length 16 measures them)")
    ap.add_argument("--make-model", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    out = Path(args.out)
    if args.make_model:
        random_model(args.config, out / "model")
        return
    from fedllm.data.synthetic import generate_arith  # not tests.conftest: importing it pins 1 OpenMP thread

    model_dir = out / "model"
    if not (model_dir / "config.json").is_file():  # in a child process: its peak is not this process's
        subprocess.run([sys.executable, __file__, "--config", args.config, "--out", args.out, "--make-model"],
                       check=True)
    records = [{**r, "question": " ".join([r["question"]] * 12)} for r in generate_arith(8)]  # past 256 tokens
    data = out.parent / f"{out.name}-arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    extra = overrides(model_dir, data, out, args.steps, args.length)
    estimate = dry_run_estimate(extra, args.config)

    from fedllm.engine.server import run
    from fedllm.recipe.checks import load_recipe
    from fedllm.strategies.frlora import FRLoRA

    idle = rss_mib()
    svd: dict[str, float] = {}
    setup = FRLoRA.setup

    def timed_setup(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return setup(self, *a, **k)
        finally:
            svd["seconds"] = time.perf_counter() - t0

    FRLoRA.setup = timed_setup
    t0 = time.perf_counter()
    result = run(load_recipe(str(RECIPE), extra))
    train_s = time.perf_counter() - t0
    peak = rss_mib() - idle
    last, run_dir = result.history[-1], result.run_dir
    del result  # the run's model (13.5 GB at 7B) goes before the export loads its own
    gc.collect()
    t1 = time.perf_counter()
    exported = export_in_a_fresh_process(run_dir, out / "merged")
    export_s = time.perf_counter() - t1
    tp, steps = last["throughput"], sum(last["client_steps"].values())
    print(json.dumps({"config": args.config, "steps": steps, "max_length": args.length,
                      "positions_per_step": tp["positions"] / steps,
                      "seconds_per_step": round(tp["train_seconds"] / steps, 2),
                      "cpu_seconds_per_step": round(tp["train_cpu_seconds"] / steps, 2),
                      "mfu": tp.get("mfu"), "mfu_per_cpu_second": tp.get("mfu_cpu"),
                      "peak_rss_above_idle_gib": round(peak / 1024, 2), "dry_run_estimate": estimate,
                      "svd_init_seconds": round(svd.get("seconds", float("nan")), 1),
                      "train_wall_seconds": round(train_s, 1), "train_peak_rss_gib": round(rss_mib() / 1024, 2),
                      "merged_export_seconds": round(export_s, 1), **exported}, indent=1))

if __name__ == "__main__":
    main()
