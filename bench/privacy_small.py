"""Utility cost of differential privacy on the small task of ``bench/repro_small.py`` (not a test).

Task and model as ``repro_small.py`` (MiniLM-L6 + LoRA classifying the operation of synthetic arithmetic problems),
but with many small clients, as client-level DP needs: ``--clients`` clients (IID split of ``--train`` problems),
``--per-round`` of them sampled uniformly without replacement each round, ``--local-steps`` AdamW steps each,
uniform FedAvg. Runs FedAvg without DP, with client-level central DP (server-side clipping to ``--clip``) at each
``--central`` noise multiplier, and with DP-SGD on the clients (per-example clipping to ``--sgd-clip``) at each
``--dp-sgd`` noise multiplier; records the held-out accuracy after the last round, the ε spent at ``--delta``
(central: the federation's ε, accounted for sampling without replacement; DP-SGD: the largest client ε) and the
norm of the global model's step per round. Prints a table and plots accuracy against ε.

    python bench/privacy_small.py --clients 200 --per-round 40 --rounds 10 --local-steps 1 --lora-r 1 --clip 1.0 \\
        --train 2000 --test 200 --delta 1e-4 --central 0.5 1 2 4 --threads 1 --plot docs/privacy_small.png \\
        --json bench/out/privacy_small.json

(the defaults; docs/privacy.md has the figures).
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
from repro_small import add_task_arguments, evaluate, task_recipe, write_splits  # noqa: E402

from fedllm.engine.server import RoundLoop, build_federation  # noqa: E402
from fedllm.recipe.checks import parse_recipe  # noqa: E402


def step_norm(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(after[k].float() - before[k].float()).flatten() for k in before]).norm())


def run_one(privacy: dict, data_dir: Path, opts) -> dict:
    federation = {"num_clients": opts.clients, "clients_per_round": opts.per_round, "rounds": opts.rounds,
                  "strategy": "fedavg", "strategy_args": {"weighting": "uniform"}, "partition": {"method": "iid"}}
    raw = task_recipe(data_dir, f"run-{len(list(data_dir.iterdir()))}", opts.seed, federation,
                      {"local_steps": opts.local_steps, "lr": opts.lr}, lora_r=opts.lora_r, privacy=privacy)
    fed = build_federation(parse_recipe(raw))
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False)
    t, cpu = time.perf_counter(), time.process_time()
    records, steps = [], []
    for rnd in range(1, opts.rounds + 1):
        before = dict(loop.global_state)
        records.append(loop.run_round(rnd, None))
        steps.append(step_norm(loop.global_state, before))
    _, acc = evaluate(fed.loaded.model, fed.data.eval_examples, fed.loaded.tokenizer.pad_token_id)
    last = records[-1]
    return {"accuracy": acc, "epsilon": last.get("epsilon"), "train_loss": last.get("train_loss"),
            "unclipped": [r.get("privacy", {}).get("unclipped") for r in records],
            "step_norm": statistics.mean(steps), "seconds": round(time.perf_counter() - t, 1),
            "cpu_seconds": round(time.process_time() - cpu, 1)}


def plot(rows: list[dict], path: Path, opts) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    base = next(r for r in rows if r["mechanism"] == "none")
    ax.axhline(base["accuracy"], color="grey", linestyle="--", label="no DP")
    ax.axhline(0.25, color="grey", linestyle=":", label="chance")
    for mech, marker in (("central", "o"), ("dp_sgd", "s")):
        pts = sorted((r["epsilon"], r["accuracy"], r["noise_multiplier"]) for r in rows if r["mechanism"] == mech)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                    label="client-level (central)" if mech == "central" else "DP-SGD (per client)")
            for eps, acc, z in pts:
                ax.annotate(f"z={z:g}", (eps, acc), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel(f"ε after {opts.rounds} rounds (δ = {opts.delta:g}; {opts.per_round} of {opts.clients} clients "
                  "sampled without replacement)", fontsize=8)
    ax.set_ylabel("held-out accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0, help="recipe seed and privacy.noise_seed")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=40, help="clients sampled per round")
    parser.add_argument("--local-steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--lora-r", type=int, default=1)
    parser.add_argument("--delta", type=float, default=1e-4)
    parser.add_argument("--clip", type=float, default=1.0, help="central: clipping norm of a client's update")
    parser.add_argument("--sgd-clip", type=float, default=1.0, help="DP-SGD: clipping norm of one example's gradient")
    parser.add_argument("--central", type=float, nargs="*", default=[0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--dp-sgd", type=float, nargs="*", default=[])
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without DP")
    parser.add_argument("--plot", default=None)
    add_task_arguments(parser, 2000, 200)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    common = {"delta": opts.delta, "noise_seed": opts.seed, "per_client_stats": True}  # the table's train loss
    settings = [] if opts.no_baseline else [{"mechanism": "none"}]
    settings += [{"mechanism": "central", "noise_multiplier": z, "clipping_norm": opts.clip, **common}
                 for z in opts.central]
    settings += [{"mechanism": "dp_sgd", "noise_multiplier": z, "clipping_norm": opts.sgd_clip, **common}
                 for z in opts.dp_sgd]
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_splits(data_dir, opts.train, opts.test)
        for privacy in settings:
            row = {"mechanism": privacy["mechanism"], "noise_multiplier": privacy.get("noise_multiplier"),
                   **run_one(privacy, data_dir, opts)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{opts.rounds} rounds, {opts.per_round} of {opts.clients} clients per round, δ = {opts.delta:g}, "
          f"{time.perf_counter() - start:.0f}s in all\n")
    print("| mechanism | noise multiplier z | ε | held-out accuracy | final train loss | step norm |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        print(f"| {r['mechanism']} | {r['noise_multiplier'] or '—'} | {eps} | {r['accuracy']:.3f} | "
              f"{'—' if r['train_loss'] is None else format(r['train_loss'], '.3f')} | {r['step_norm']:.3g} |")
    if opts.plot:
        plot(rows, Path(opts.plot), opts)
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
