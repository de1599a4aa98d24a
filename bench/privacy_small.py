"""Utility cost of differential privacy on the small task of ``bench/repro_small.py`` (not a test).

Task, model and split as ``repro_small.py`` (MiniLM-L6 + LoRA r=8 classifying the operation of synthetic arithmetic
problems; ``--clients`` clients, Dirichlet(``--beta``) label skew, all training every round, AdamW, uniform
averaging). Runs FedAvg without DP, with client-level central DP (server-side clipping to ``--clip``) at each
``--central`` noise multiplier, and with DP-SGD on the clients (per-example clipping to ``--sgd-clip``) at each
``--dp-sgd`` noise multiplier; records the held-out accuracy after the last round and the ε spent at
``--delta`` (central: the federation's ε; DP-SGD: the largest client ε). Prints a table and plots accuracy
against ε.

    python bench/privacy_small.py --rounds 4 --local-steps 3 --threads 1 --plot docs/privacy_small.png \\
        --json bench/out/privacy_small.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repro_small import evaluate  # noqa: E402

from fedllm.config import parse_recipe  # noqa: E402
from fedllm.data.synthetic import arith_splits  # noqa: E402
from fedllm.server import RoundLoop, build_federation  # noqa: E402


def run_one(privacy: dict, data_dir: Path, opts) -> dict:
    raw = {
        "seed": opts.seed, "output_dir": str(data_dir / f"run-{len(list(data_dir.iterdir()))}"),
        "model": {"name": "minilm-l6"}, "lora": {"r": 8, "alpha": 16},
        "data": {"path": str(data_dir / "train.jsonl"), "eval_path": str(data_dir / "test.jsonl"),
                 "format": "classification", "fields": {"text": "question", "label": "category"}},
        "federation": {"num_clients": opts.clients, "clients_per_round": opts.clients, "rounds": opts.rounds,
                       "strategy": "fedavg", "strategy_args": {"weighting": "uniform"},
                       "partition": {"method": "dirichlet", "beta": opts.beta, "column": "category", "min_size": 8}},
        "train": {"local_steps": opts.local_steps, "batch_size": 8, "lr": opts.lr, "max_length": 48},
        "logging": {"progress": False, "quiet": True}, "privacy": privacy,
    }
    fed = build_federation(parse_recipe(raw))
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False)
    t = time.perf_counter()
    records = [loop.run_round(rnd, None) for rnd in range(1, opts.rounds + 1)]
    _, acc = evaluate(fed.loaded.model, fed.data.eval_examples, fed.loaded.tokenizer.pad_token_id)
    last = records[-1]
    return {"accuracy": acc, "epsilon": last.get("epsilon"), "train_loss": last["train_loss"],
            "unclipped": [r.get("privacy", {}).get("unclipped") for r in records],
            "seconds": round(time.perf_counter() - t, 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    base = next(r for r in rows if r["mechanism"] == "none")
    ax.axhline(base["accuracy"], color="grey", linestyle="--", label="no DP")
    for mech, marker in (("central", "o"), ("dp_sgd", "s")):
        pts = sorted((r["epsilon"], r["accuracy"], r["noise_multiplier"]) for r in rows if r["mechanism"] == mech)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker,
                    label="client-level (central)" if mech == "central" else "DP-SGD (per client)")
            for eps, acc, z in pts:
                ax.annotate(f"z={z:g}", (eps, acc), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("ε spent (δ as in the table)")
    ax.set_ylabel("held-out accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--beta", type=float, default=1.0, help="Dirichlet concentration")
    parser.add_argument("--train", type=int, default=200)
    parser.add_argument("--test", type=int, default=100)
    parser.add_argument("--delta", type=float, default=1e-3)
    parser.add_argument("--clip", type=float, default=0.5, help="central: clipping norm of a client's update")
    parser.add_argument("--sgd-clip", type=float, default=1.0, help="DP-SGD: clipping norm of one example's gradient")
    parser.add_argument("--central", type=float, nargs="*", default=[0.3, 1.0, 3.0])
    parser.add_argument("--dp-sgd", type=float, nargs="*", default=[0.5, 1.0, 2.0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    settings = [{"mechanism": "none"}]
    settings += [{"mechanism": "central", "noise_multiplier": z, "clipping_norm": opts.clip, "delta": opts.delta}
                 for z in opts.central]
    settings += [{"mechanism": "dp_sgd", "noise_multiplier": z, "clipping_norm": opts.sgd_clip, "delta": opts.delta}
                 for z in opts.dp_sgd]
    rows = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        train, test = arith_splits(opts.train, opts.test, seed=0)
        for split, records in (("train", train), ("test", test)):
            (data_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        for privacy in settings:
            row = {"mechanism": privacy["mechanism"], "noise_multiplier": privacy.get("noise_multiplier"),
                   **run_one(privacy, data_dir, opts)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{opts.rounds} rounds, {opts.clients} clients, δ = {opts.delta:g}, "
          f"{time.perf_counter() - start:.0f}s in all\n")
    print("| mechanism | noise multiplier z | ε | held-out accuracy | final train loss |\n|---|---|---|---|---|")
    for r in rows:
        eps = "—" if r["epsilon"] is None else f"{r['epsilon']:.3g}"
        print(f"| {r['mechanism']} | {r['noise_multiplier'] or '—'} | {eps} | {r['accuracy']:.3f} | "
              f"{r['train_loss']:.3f} |")
    if opts.plot:
        plot(rows, Path(opts.plot))
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
