"""bf16 (``train.dtype: auto`` on a CPU with avx512_bf16/AMX) against fp32 over seeds: the accuracy each reaches.

Issue #39 item 1 asks that bf16 be within one standard deviation of fp32 over 3 seeds. This runs ``fedllm train
RECIPE seed=S output_dir=OUT/s<S>-<dtype>`` for each seed and dtype, interleaved (seed 0 in every dtype, then
seed 1, ...) so that a change in the machine's load falls on both, and reads each run's ``summary.json`` (the
accuracy before and after training, the dtypes the run resolved) and ``metrics.jsonl`` (the loss per round). Wall
and CPU seconds are the child process's (``resource.getrusage(RUSAGE_CHILDREN)``, user + system). It prints one
row per run and, per dtype, the mean ± sample standard deviation (n − 1) of the accuracies, and whether bf16's
mean accuracy is within one fp32 standard deviation of fp32's mean, with the largest per-round loss difference
between the runs of one seed.

    python data_prep/make_arith.py --out data/arith
    python bench/dtype_seeds.py --seeds 0 1 2 --threads 1 --json bench/out/dtype_seeds.json

``--dtypes`` names what each run sets: ``auto`` (``train.dtype=auto model.dtype=auto``), ``fp32``
(``train.dtype=fp32 model.dtype=fp32``, the fp32 output README quotes) or ``bf16``. ``--json`` is written after
every run; ``--resume`` skips the runs already in it (a session cut off goes on where it stopped).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "recipes" / "quickstart" / "smollm2-arith-fedavg.yaml"
#: What each ``--dtypes`` name sets (``model.dtype`` follows ``train.dtype``: the base weights in the compute dtype).
DTYPE_OVERRIDES = {
    "auto": ["train.dtype=auto", "model.dtype=auto"],
    "fp32": ["train.dtype=fp32", "model.dtype=fp32"],
    "bf16": ["train.dtype=bf16", "model.dtype=bf16"],
}


def run_plan(seeds: list[int], dtypes: list[str]) -> list[tuple[int, str]]:
    """The runs in the order they go: each seed in every dtype before the next seed (interleaved)."""
    return [(seed, dtype) for seed in seeds for dtype in dtypes]


def run_dir(out: Path, seed: int, dtype: str) -> Path:
    return out / f"s{seed}-{dtype}"


def train_command(recipe: Path, seed: int, dtype: str, out: Path, threads: int | None, extra: list[str]) -> list[str]:
    """``fedllm train`` of one run (``python -m fedllm``: the interpreter running this bench)."""
    return [sys.executable, "-m", "fedllm", "train", str(recipe), f"seed={seed}",
            f"output_dir={run_dir(out, seed, dtype)}", *DTYPE_OVERRIDES[dtype],
            *([f"train.threads={threads}"] if threads else []), *extra]


def accuracy_key(evaluation: dict, metric: str | None) -> str:
    """``metric``, or the first key of an evaluation that ends in ``accuracy`` (``gsm8k/accuracy``)."""
    if metric:
        return metric
    keys = [k for k in evaluation if k.endswith("accuracy")]
    if not keys:
        raise SystemExit(f"no accuracy among the evaluation's keys {sorted(evaluation)}: name one with --metric")
    return keys[0]


def read_run(directory: Path, metric: str | None) -> dict:
    """What a finished run reports: the resolved dtypes, the accuracy before and after, the loss per round."""
    summary = json.loads((directory / "summary.json").read_text())
    final = summary["final_eval"]
    key = accuracy_key(final, metric)
    rounds = [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"metric": key, "resolved": summary.get("dtype"),
            "before": (summary.get("initial_eval") or {}).get(key), "after": final[key],
            "losses": [r["train_loss"] for r in rounds if r.get("round", 0) >= 1 and "train_loss" in r]}


def run_one(recipe: Path, seed: int, dtype: str, opts: argparse.Namespace) -> dict:
    """Train one run in a child process and read what it reports, with the child's wall and CPU seconds."""
    directory = run_dir(opts.out, seed, dtype)
    if directory.exists():
        raise SystemExit(f"{directory} exists: give another --out (or --resume with the --json that recorded it)")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(train_command(recipe, seed, dtype, opts.out, opts.threads, opts.set),
                          check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    (opts.out / f"s{seed}-{dtype}.log").write_text(done.stdout)
    if done.returncode:
        raise SystemExit(f"seed {seed} {dtype}: fedllm train exited {done.returncode}; its output: "
                         f"{opts.out / f's{seed}-{dtype}.log'}\n{done.stdout[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seed": seed, "dtype": dtype, **read_run(directory, opts.metric), "wall_s": wall, "cpu_s": cpu}


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n − 1; 0 for one value)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def compare(runs: list[dict], reference: str = "fp32") -> dict:
    """Per dtype the accuracy after (and before) as mean ± std, the mean loss per round, wall and CPU; for each
    other dtype, whether its mean accuracy after is within one ``reference`` standard deviation of the reference
    mean, and the largest |loss difference| over the rounds of the seeds both ran."""
    by_dtype: dict[str, list[dict]] = {}
    for run in runs:
        by_dtype.setdefault(run["dtype"], []).append(run)
    out: dict = {"dtypes": {}}
    for dtype, rows in by_dtype.items():
        befores = [r["before"] for r in rows if r["before"] is not None]
        out["dtypes"][dtype] = {
            "seeds": [r["seed"] for r in rows], "after": mean_std([r["after"] for r in rows]),
            "before": mean_std(befores) if befores else None,
            "losses": [statistics.mean(v) for v in zip(*[r["losses"] for r in rows], strict=True)],
            "wall_s": statistics.mean(r["wall_s"] for r in rows), "cpu_s": statistics.mean(r["cpu_s"] for r in rows)}
    ref = out["dtypes"].get(reference)
    if ref is None:
        return out
    ref_runs = {r["seed"]: r for r in by_dtype[reference]}
    for dtype, stats in out["dtypes"].items():
        if dtype == reference:
            continue
        gap = stats["after"][0] - ref["after"][0]
        paired = [(r, ref_runs[r["seed"]]) for r in by_dtype[dtype] if r["seed"] in ref_runs]
        stats["vs_" + reference] = {
            "accuracy_gap": gap, "within_one_std": abs(gap) <= ref["after"][1],
            "max_loss_diff": max((abs(a - b) for r, f in paired for a, b in zip(r["losses"], f["losses"], strict=True)),
                                 default=None)}
    return out


def table(runs: list[dict], comparison: dict) -> str:
    """The runs, one row each, then mean ± std per dtype and the verdict against fp32."""
    metric = runs[0]["metric"] if runs else "accuracy"
    lines = [f"| seed | dtype (train/model) | {metric} before | after | loss per round | wall s | CPU s |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        resolved = r["resolved"] or {}
        name = f"{r['dtype']} ({resolved.get('train', '?')}/{resolved.get('model', '?')})"
        before = "—" if r["before"] is None else f"{r['before']:.4f}"
        losses = " ".join(f"{x:.4f}" for x in r["losses"])
        lines.append(f"| {r['seed']} | {name} | {before} | {r['after']:.4f} | {losses} | {r['wall_s']:.1f} | "
                     f"{r['cpu_s']:.1f} |")
    lines += ["", "| dtype | seeds | before (mean ± std) | after (mean ± std) | mean loss per round | wall s | CPU s |",
              "|---|---|---|---|---|---|---|"]
    for dtype, s in comparison["dtypes"].items():
        before = "—" if s["before"] is None else f"{s['before'][0]:.4f} ± {s['before'][1]:.4f}"
        losses = " ".join(f"{x:.4f}" for x in s["losses"])
        lines.append(f"| {dtype} | {' '.join(map(str, s['seeds']))} | {before} | {s['after'][0]:.4f} ± "
                     f"{s['after'][1]:.4f} | {losses} | {s['wall_s']:.1f} | {s['cpu_s']:.1f} |")
    for dtype, s in comparison["dtypes"].items():
        verdict = s.get("vs_fp32")
        if verdict:
            loss = "—" if verdict["max_loss_diff"] is None else f"{verdict['max_loss_diff']:.4f}"
            lines.append(f"\n{dtype} vs fp32: mean accuracy {verdict['accuracy_gap']:+.4f}, "
                         f"{'within' if verdict['within_one_std'] else 'NOT within'} one fp32 standard deviation "
                         f"({comparison['dtypes']['fp32']['after'][1]:.4f}); largest per-round loss difference "
                         f"between the runs of one seed {loss}")
    return "\n".join(lines)


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=QUICKSTART, help="default: the quickstart")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["auto", "fp32"], choices=sorted(DTYPE_OVERRIDES))
    parser.add_argument("--threads", type=int, default=None, help="train.threads of every run (default: fedllm's)")
    parser.add_argument("--metric", default=None, help="the accuracy key of final_eval (default: the first *accuracy)")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="more recipe overrides for every run")
    parser.add_argument("--out", type=Path, default=Path("bench/out/dtype_seeds"), help="the runs' directories")
    parser.add_argument("--json", type=Path, default=None, help="the runs and the comparison, written after each run")
    parser.add_argument("--resume", action="store_true", help="skip the runs --json already holds")
    opts = parser.parse_args(argv)
    if opts.threads is not None and opts.threads <= 0:
        parser.error(f"--threads {opts.threads}: expected a positive integer")
    if len(set(opts.dtypes)) != len(opts.dtypes) or len(set(opts.seeds)) != len(opts.seeds):
        parser.error(f"--dtypes {' '.join(opts.dtypes)} / --seeds {' '.join(map(str, opts.seeds))}: expected no repeats")
    bad = [s for s in opts.set if "=" not in s]
    if bad:
        parser.error(f"--set {' '.join(bad)}: expected KEY=VALUE")
    if opts.resume and not opts.json:
        parser.error("--resume: expected --json (the file that holds the runs done)")
    if not opts.recipe.is_file():
        parser.error(f"--recipe {opts.recipe}: no such file")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse_options(argv)
    runs: list[dict] = []
    if opts.resume and opts.json.exists():
        runs = json.loads(opts.json.read_text())["runs"]
    done = {(r["seed"], r["dtype"]) for r in runs}
    opts.out.mkdir(parents=True, exist_ok=True)
    for seed, dtype in run_plan(opts.seeds, opts.dtypes):
        if (seed, dtype) in done:
            continue
        runs.append(run_one(opts.recipe, seed, dtype, opts))
        r = runs[-1]
        print(f"seed {seed} {dtype:>4}: {r['metric']} {r['before']} -> {r['after']}  losses "
              f"{' '.join(f'{x:.4f}' for x in r['losses'])}  {r['wall_s']:.0f}s wall {r['cpu_s']:.0f} CPU-s", flush=True)
        if opts.json:
            opts.json.parent.mkdir(parents=True, exist_ok=True)
            opts.json.write_text(json.dumps({"options": {k: str(v) for k, v in vars(opts).items()}, "runs": runs,
                                             "comparison": compare(runs)}, indent=1))
    order = {key: i for i, key in enumerate(run_plan(opts.seeds, opts.dtypes))}
    runs = sorted((r for r in runs if (r["seed"], r["dtype"]) in order), key=lambda r: order[r["seed"], r["dtype"]])
    print()
    print(table(runs, compare(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
