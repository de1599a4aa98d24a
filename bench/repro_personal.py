"""Personalized FL at small scale on a CPU: where FedAvg must fail (not a test; a few minutes on 2 cores).

Task: classify the operation (add / sub / mul / div) of the expression in the worked solution of synthetic
arithmetic word problems (``fedllm.data.synthetic``; text like ``50 + 98``) with the tiny RoBERTa preset (random init, 2 layers, hidden 64; LoRA r=8 on
query/key/value/attention-output, classifier head trained), 8 clients, half of them sampled per round,
each holding out a quarter of its problems as its personal test split. Two splits:

- ``permuted``: an even random split into 4 groups of 2 clients whose label names are permuted per group
  (pFL^MF's setup 3, ``fedllm.data.label_groups``): the inputs are alike, the right answer is not, so no
  single model fits every group;
- ``dirichlet``: Dirichlet(0.1) label skew over the operation (seed 002's and pFL^MF's setup 1 shape).

Methods: local, FedAvg, pFedLoRU, FedLoRA (alternating = pFedLoRA(1), simultaneous = pFedLoRA(2); σ =
the target modules' full weights, τ rank 8), pFL^MF (rank 4, plain SGD on v with η_v = 0.5, η_U = 0.5), FedSA-LoRA. Reported per
method and split, mean ± std over seeds: the clients' mean and minimum personal accuracy (each client's
own model on its own test split; FedAvg's global model on each split) after the last round, and the bytes
sent per round (up + down, fp32). Prints a table and saves a plot.

    python bench/repro_personal.py --seeds 0 1 2 --plot docs/repro_personal.png --json bench/out/repro_personal.json
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedllm.data.collate import collate
from fedllm.data.label_groups import permute_label_groups
from fedllm.data.synthetic import arith_splits
from fedllm.engine.server import RoundLoop, build_federation
from fedllm.models.loading import read_state, write_state
from fedllm.recipe.checks import parse_recipe

METHODS: dict[str, tuple[str, dict, dict]] = {  # name -> strategy, strategy_args, train overrides
    "local": ("local", {}, {}),
    "FedAvg": ("fedavg", {}, {}),
    "pFedLoRU": ("pfedloru", {"personal_r": 8, "tau": 1000}, {}),
    "FedLoRA alt": ("fedlora_pfl", {"schedule": "alternating", "rank": 8}, {}),
    "FedLoRA sim": ("fedlora_pfl", {"schedule": "simultaneous", "rank": 8}, {}),
    "pFL^MF": ("pflmf", {"rank": 4, "eta_u": 0.5}, {"optimizer": "sgd", "lr": 0.5}),
    "FedSA-LoRA": ("fedsa_lora", {}, {}),
}
SPLITS = ("permuted", "dirichlet")
EXPRESSION = re.compile(r"(\d+ [-+*/] \d+) =")


def problems(n: int) -> list[dict]:
    """``{"text": "50 + 98", "category": "add"}``: the expression of each synthetic problem's worked solution."""
    train, _ = arith_splits(n, 1, seed=0)
    return [{"text": EXPRESSION.search(r["answer"]).group(1), "category": r["category"]} for r in train]


def write_data(root: Path, split: str, seed: int, opts: argparse.Namespace) -> dict:
    """The split's data file and partition section."""
    train = problems(opts.train)
    if split == "permuted":
        rows, _ = permute_label_groups(train, opts.clients, opts.groups, seed, column="category")
        partition = {"method": "natural", "column": "client"}
    else:
        rows = train
        partition = {"method": "dirichlet", "beta": 0.1, "column": "category", "min_size": 12}
    path = root / f"{split}-{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"path": str(path), "partition": partition}


@torch.no_grad()
def accuracy(model, examples: list[dict], pad_id: int) -> float:
    was = model.training
    model.eval()
    batch = collate(examples, pad_id, "classification")
    correct = int((model(**batch).logits.argmax(-1) == batch["labels"]).sum())
    model.train(was)
    return correct / len(examples)


def personal_accuracies(loop: RoundLoop) -> list[float]:
    """Each client's own model (the global one for FedAvg) on its own held-out split."""
    fed, model = loop.fed, loop.model
    pad, out = fed.loaded.tokenizer.pad_token_id, []
    for cid in range(loop.recipe.federation.num_clients):
        personal = fed.strategy.personal_state(cid, loop.store.get(cid)) if fed.strategy.personalized else None
        if personal is None:
            out.append(accuracy(model, fed.data.client_eval[cid], pad))
            continue
        saved = read_state(model, personal.keys())
        write_state(model, personal)
        try:
            out.append(accuracy(model, fed.data.client_eval[cid], pad))
        finally:
            write_state(model, saved)
    return out


def run_one(method: str, split: str, seed: int, root: Path, opts: argparse.Namespace) -> dict:
    strategy, args, train = METHODS[method]
    data = write_data(root, split, seed, opts)
    raw = {
        "seed": seed, "output_dir": str(root / f"run-{method}-{split}-{seed}".replace(" ", "_")),
        "model": {"name": "tiny-roberta"}, "lora": {"r": 8, "alpha": 16},
        "data": {"path": data["path"], "format": "classification", "client_eval_fraction": 0.25,
                 "fields": {"label": "category"}, "labels": ["add", "div", "mul", "sub"]},
        "federation": {"num_clients": opts.clients, "fraction": opts.fraction, "rounds": opts.rounds,
                       "strategy": strategy, "strategy_args": args, "partition": data["partition"]},
        "train": {"local_steps": opts.local_steps, "batch_size": 8, "lr": opts.lr, "max_length": 16, **train},
        "logging": {"progress": False, "quiet": True},
    }
    fed = build_federation(parse_recipe(raw))
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False)
    curve, sent = [], []
    for rnd in range(1, opts.rounds + 1):
        record = loop.run_round(rnd, None)
        sent.append(record["bytes_up_total"] + record["bytes_down_total"])
        if rnd % opts.eval_every == 0 or rnd == opts.rounds:
            accs = personal_accuracies(loop)
            curve.append({"round": rnd, "mean": statistics.mean(accs), "min": min(accs)})
    return {"curve": curve, "mean": curve[-1]["mean"], "min": curve[-1]["min"],
            "bytes_per_round": statistics.mean(sent)}


def ms(values: list[float], fmt: str = ".3f") -> str:
    return f"{statistics.mean(values):{fmt}} ± {statistics.pstdev(values):{fmt}}"


def summarize(results: dict) -> str:
    lines = ["| method | " + " | ".join(f"{s} mean acc | {s} min acc" for s in SPLITS) + " | bytes / round |",
             "|---|" + "---|---|" * len(SPLITS) + "---|"]
    for method, per_split in results.items():
        cells = []
        for split in SPLITS:
            runs = per_split[split]
            cells += [ms([r["mean"] for r in runs]), ms([r["min"] for r in runs])]
        size = statistics.mean(r["bytes_per_round"] for s in SPLITS for r in per_split[s])
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {size / 1e3:.0f} kB |")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SPLITS), figsize=(6 * len(SPLITS), 4), sharey=True)
    for ax, split in zip(axes, SPLITS, strict=True):
        for method, per_split in results.items():
            runs = per_split[split]
            rounds = [p["round"] for p in runs[0]["curve"]]
            mean = [statistics.mean(r["curve"][i]["mean"] for r in runs) for i in range(len(rounds))]
            ax.plot(rounds, mean, marker="o", markersize=3, label=method)
        ax.set_title(f"{split}: mean personal accuracy")
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW lr (pFL^MF: plain SGD, see METHODS)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4, help="label-permuted groups")
    parser.add_argument("--fraction", type=float, default=0.5, help="clients sampled per round")
    parser.add_argument("--train", type=int, default=800, help="problems over all clients")
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--plot", default="docs/repro_personal.png")
    parser.add_argument("--json", default=None)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    results: dict = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for method in opts.methods:
            results[method] = {}
            for split in SPLITS:
                results[method][split] = []
                for seed in opts.seeds:
                    t = time.perf_counter()
                    res = run_one(method, split, seed, Path(tmp), opts)
                    results[method][split].append(res)
                    print(f"{method:>12} {split:>9} seed {seed}: mean {res['mean']:.3f} min {res['min']:.3f} "
                          f"({time.perf_counter() - t:.1f}s)", flush=True)
    print(f"\n{len(opts.seeds)} seeds, {opts.rounds} rounds, {time.perf_counter() - start:.0f}s in all\n")
    print(summarize(results))
    if opts.plot:
        plot(results, Path(opts.plot))
        print(f"\nplot: {opts.plot}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "results": results}, indent=1))


if __name__ == "__main__":
    main()
