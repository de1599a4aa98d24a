"""Synchronous rounds against FedBuff (``federation.mode: async``) with one slow site: virtual time to the same
held-out loss (issue 50, item 5; not a test).

Task and model as ``bench/repro_small.py``: classify the operation of synthetic arithmetic problems with MiniLM-L6
+ LoRA (r=8), split IID over ``--clients`` clients (5). One local step takes 1 virtual second on every client but the
last, which takes ``--slow`` (5) seconds: the slow site. Both runs train for real; only time is virtual, so the
comparison does not depend on this machine's load.

- ``sync``: FedAvg, every client in every round; a round lasts as long as its slowest client
  (``max_i steps_i x seconds per step_i``: the slow site, every round).
- ``async``: FedBuff with FedAvg's step (``η_g = 1``), every client training at once (``M`` = clients), a server step
  every ``--buffer`` (2) uploads weighted by ``1/sqrt(1+τ)``; its virtual time is the arrival of the step's last
  upload (``metrics.jsonl``'s ``async.virtual_time_s``). It runs until its virtual time passes the sync run's end.

After every round (server step) the global model's held-out loss and accuracy are measured. The target is the
sync run's held-out loss after its last round; the table gives each run's virtual time to first reach it (linear
interpolation is not used: the time of the first round at or below it).

    python bench/async_rounds.py --seeds 0 1 --rounds 6 --threads 2 --json bench/out/async_rounds.json \
        --plot docs/async_rounds.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repro_small import add_task_arguments, evaluate, task_recipe, write_splits

from fedllm.engine.server import RoundLoop, build_federation
from fedllm.recipe.checks import parse_recipe


def run_one(mode: str, seed: int, data_dir: Path, opts, until_s: float | None = None) -> list[dict]:
    """``[{round, virtual_s, eval_loss, accuracy}]`` of one run (round 0: before training)."""
    seconds = [1.0] * (opts.clients - 1) + [opts.slow]
    federation = {"num_clients": opts.clients, "clients_per_round": opts.clients, "partition": {"method": "iid"},
                  "rounds": opts.rounds if mode == "sync" else 10_000}
    if mode == "async":
        federation.update(mode="async", async_buffer_size=opts.buffer, async_step_seconds=seconds)
    raw = task_recipe(data_dir, f"run-{mode}-{seed}", seed, federation,
                      {"local_steps": opts.local_steps, "lr": opts.lr})
    fed = build_federation(parse_recipe(raw))
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False)
    model, pad = fed.loaded.model, fed.loaded.tokenizer.pad_token_id
    loss, acc = evaluate(model, fed.data.eval_examples, pad)
    rows, clock, rnd = [{"round": 0, "virtual_s": 0.0, "eval_loss": loss, "accuracy": acc}], 0.0, 0
    while (rnd < opts.rounds) if mode == "sync" else (clock < until_s):
        rnd += 1
        record = loop.run_round(rnd, None)
        if mode == "sync":
            clock += max(steps * seconds[int(c)] for c, steps in record["client_steps"].items())
        else:
            clock = record["async"]["virtual_time_s"]
        loss, acc = evaluate(model, fed.data.eval_examples, pad)
        rows.append({"round": rnd, "virtual_s": clock, "eval_loss": loss, "accuracy": acc,
                     **({"staleness": [a["staleness"] for a in record["async"]["aggregated"]]}
                        if mode == "async" else {})})
    return rows


def time_to(rows: list[dict], target: float) -> float | None:
    """Virtual seconds of the first round whose held-out loss is at or below ``target`` (None: never)."""
    return next((r["virtual_s"] for r in rows if r["eval_loss"] <= target), None)


def uploads_to(rows: list[dict], target: float, per_round: int | None = None) -> int | None:
    """Uploads aggregated until the first round at or below ``target`` (``per_round``: a sync round's)."""
    for i, r in enumerate(rows):
        if r["eval_loss"] <= target:
            return i * per_round if per_round else sum(len(x["staleness"]) for x in rows[1:i + 1])
    return None


def table(results: dict[str, list[list[dict]]], opts: argparse.Namespace) -> str:
    """The Markdown table of the runs (target: the sync run's held-out loss after its last round)."""
    lines = [(f"{len(opts.seeds)} seed(s), {opts.clients} clients (the last {opts.slow:g}x slower), "
              f"{opts.local_steps} local steps, K={opts.buffer}\n"),
             ("| seed | target held-out loss (sync's last) | virtual s to it: sync / async | speed-up | uploads "
              "aggregated to it: sync / async | async server steps to it | mean staleness | final accuracy: sync / "
              "async |"), "|---|---|---|---|---|---|---|---|"]
    for seed, sync, asyn in zip(opts.seeds, results["sync"], results["async"], strict=True):
        target = sync[-1]["eval_loss"]
        t_sync, t_async = time_to(sync, target), time_to(asyn, target)
        steps = next((i for i, r in enumerate(asyn) if r["eval_loss"] <= target), None)
        stale = statistics.mean(s for r in asyn[1:] for s in r["staleness"])
        lines.append(f"| {seed} | {target:.4f} | {t_sync:g} / {t_async if t_async is not None else 'never'} | "
                     f"{f'{t_sync / t_async:.2f}x' if t_async else '-'} | {uploads_to(sync, target, opts.clients)} / "
                     f"{uploads_to(asyn, target)} | {steps} | {stale:.2f} | {sync[-1]['accuracy']:.3f} / "
                     f"{asyn[-1]['accuracy']:.3f} |")
    return "\n".join(lines)


def plot(results: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for (mode, runs), color in zip(results.items(), ("tab:blue", "tab:orange"), strict=False):
        for i, rows in enumerate(runs):
            ax.plot([r["virtual_s"] for r in rows], [r["eval_loss"] for r in rows], marker=".", color=color,
                    alpha=0.8, label=mode if i == 0 else None)
    ax.set_xlabel("virtual seconds (1 s per local step; the slow site 5 s)")
    ax.set_ylabel("held-out loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--rounds", type=int, default=6, help="synchronous rounds")
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--buffer", type=int, default=2, help="FedBuff's K")
    parser.add_argument("--slow", type=float, default=5.0, help="the slow site's seconds per local step")
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--summarize", default=None, help="print the table (and --plot) of a saved --json, no runs")
    add_task_arguments(parser, 200, 100)
    opts = parser.parse_args()
    if opts.summarize:
        saved = json.loads(Path(opts.summarize).read_text())
        print(table(saved["results"], argparse.Namespace(**saved["options"])))
        if opts.plot:
            plot(saved["results"], Path(opts.plot))
        return
    if opts.threads:
        torch.set_num_threads(opts.threads)
    results: dict[str, list[list[dict]]] = {"sync": [], "async": []}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_splits(data_dir, opts.train, opts.test)
        for seed in opts.seeds:
            results["sync"].append(run_one("sync", seed, data_dir, opts))
            results["async"].append(run_one("async", seed, data_dir, opts, results["sync"][-1][-1]["virtual_s"]))
    print(f"{time.perf_counter() - start:.0f} s in all")
    print(table(results, opts))
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "results": results}, indent=1))
    if opts.plot:
        plot(results, Path(opts.plot))


if __name__ == "__main__":
    main()
