"""Small-scale check of FRLoRA's and FedLoRU's orderings on CPU (not a test; a few minutes on 2 cores).

Task: classify the operation (add / sub / mul / div) of synthetic arithmetic word problems
(``fedllm.data.synthetic``) with MiniLM-L6 (preset ``minilm-l6``: a real pretrained 6-layer BERT encoder,
its classification head new), split over 4 clients with Dirichlet(beta) label skew, all 4 training every
round (as FRLoRA's NLU setting), LoRA r=8 alpha=16 on q/k/v/attention-output, AdamW with per-client
state and uniform averaging (as FRLoRA's official code) for every method. Methods: FedAvg (= FedLoRA:
LoRA without accumulation), FRLoRA, FRLoRA-v1, FRLoRA-v2, FedLoRU (accumulate every ``--tau`` rounds).

Per round it records the clients' mean training loss, the global model's loss and accuracy on the
held-out problems (``--test``, 200), and the mean numerical rank (rtol 1e-3) over the LoRA layers of the learned change
``W̃ − W0`` (what the layer computes now minus what it computed before training, read by feeding
it the identity). Prints a table (mean ± std over seeds) and saves a plot.

    python bench/repro_small.py --seeds 0 1 2 --rounds 12 --plot docs/repro_small.png --json bench/out/repro_small.json

``--compression none int8 nf4 nf4-noef ...`` runs FedAvg with each ``federation.compression`` (on the upload and
the download; ``-noef``: no error feedback) and reports it as ``--all`` does (docs/compression.md):

    python bench/repro_small.py --compression none int8 int8-noef nf4 nf4-noef fp4 fp4-noef --seeds 0 1 2 \
        --threads 1 --plot docs/compression_small.png --json bench/out/compression_small.json

(``--compression-strategies 'fedadam:{"eta": 0.003}' frlora --compression none down:nf4``: those strategies
with those arguments, the download alone compressed.)

``--dtype fp32|bf16|auto`` sets ``train.dtype`` and ``model.dtype`` of every run (default ``auto``, fedllm's: bf16 on a
CPU with avx512_bf16/AMX; docs/performance.md compares the two over 3 seeds).

``--all`` instead runs every registered strategy that has a global model (personalized ones are
left out), each with its documented defaults (FedLoRU: ``tau = --tau``), on the same task and split,
and prints them side by side: final accuracy and held-out loss (evaluated once, after the last
round), final training loss, bytes up and down per round (from ``metrics.jsonl``'s counts) and
seconds per run; the plot shows the training loss per round and the final accuracy, bytes and time:

    python bench/repro_small.py --all --seeds 0 1 2 --rounds 3 --local-steps 2 --lr 1e-2 --train 120 --test 100 \
        --threads 1 --plot docs/baselines_small.png --json bench/out/baselines_small.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from fedllm.common.registry import strategies
from fedllm.data.collate import collate
from fedllm.data.synthetic import arith_splits
from fedllm.engine.server import RoundLoop, build_federation
from fedllm.models.loading import lora_layers
from fedllm.models.lowrank import numerical_rank
from fedllm.recipe.checks import parse_recipe

METHODS = {
    "FedAvg (=FedLoRA)": ("fedavg", {"weighting": "uniform"}),
    "FRLoRA": ("frlora", {"weighting": "uniform"}),
    "FRLoRA-v1": ("frlora_v1", {"weighting": "uniform"}),
    "FRLoRA-v2": ("frlora_v2", {"weighting": "uniform"}),
    "FedLoRU": ("fedloru", {"weighting": "uniform"}),
}


def global_methods() -> dict[str, tuple[str, dict]]:
    """Every registered strategy with a global model, under its registry name, with default arguments."""
    import fedllm.strategies  # noqa: F401  (registers the built-in strategies)

    return {name: (name, {}) for name in strategies.names() if not strategies.get(name).personalized}


@torch.no_grad()
def layer_weights(model) -> dict[str, torch.Tensor]:
    """What each LoRA layer computes, as an ``out × in`` matrix (identity fed through it, bias removed)."""
    was = model.training
    model.eval()
    out = {}
    for name in lora_layers(model):
        module = model.get_submodule(name)
        if module.get_base_layer().weight.dtype != torch.float32:  # a bf16 base (--dtype): an fp32 copy, whose
            module = copy.deepcopy(module).float()  # output is not rounded to bf16 at the weights' magnitude
        y = module(torch.eye(module.in_features)).float()
        bias = module.get_base_layer().bias
        out[name] = (y - (bias.float() if bias is not None else 0)).T
    model.train(was)
    return out


@torch.no_grad()
def evaluate(model, examples: list[dict], pad_id: int, batch_size: int = 50) -> tuple[float, float]:
    """``(mean loss, accuracy)`` of the global model on held-out classification examples."""
    was = model.training
    model.eval()
    loss, correct = 0.0, 0
    for i in range(0, len(examples), batch_size):
        batch = collate(examples[i:i + batch_size], pad_id, "classification")
        out = model(**batch)
        n = len(batch["labels"])
        loss += float(out.loss) * n
        correct += int((out.logits.argmax(-1) == batch["labels"]).sum())
    model.train(was)
    return loss / len(examples), correct / len(examples)


def write_splits(data_dir: Path, n_train: int, n_test: int) -> None:
    """The task's ``train.jsonl`` and ``test.jsonl`` (``fedllm.data.synthetic.arith_splits``, seed 0) in ``data_dir``."""
    train, test = arith_splits(n_train, n_test, seed=0)
    for split, rows in (("train", train), ("test", test)):
        (data_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def task_recipe(data_dir: Path, run_name: str, seed: int, federation: dict, train: dict, lora_r: int = 8,
                **sections) -> dict:
    """The raw recipe of one run on the task: MiniLM-L6 + LoRA (alpha = 2r) classifying the operation of the
    problems in ``data_dir``; ``train`` is merged into batch 8 / max length 48, ``sections`` added as they are."""
    return {
        "seed": seed, "output_dir": str(data_dir / run_name),
        "model": {"name": "minilm-l6"}, "lora": {"r": lora_r, "alpha": 2 * lora_r},
        "data": {"path": str(data_dir / "train.jsonl"), "eval_path": str(data_dir / "test.jsonl"),
                 "format": "classification", "fields": {"text": "question", "label": "category"}},
        "federation": federation, "train": {"batch_size": 8, "max_length": 48, **train},
        "logging": {"progress": False, "quiet": True}, **sections,
    }


def add_task_arguments(parser: argparse.ArgumentParser, n_train: int, n_test: int) -> None:
    """The options every bench on this task shares: split sizes, CPU threads, JSON output."""
    parser.add_argument("--train", type=int, default=n_train, help="training problems")
    parser.add_argument("--test", type=int, default=n_test, help="held-out problems")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)


def compression_section(spec: str) -> dict:
    """``federation.compression`` of a ``--compression`` SPEC: ``none``, or ``int8`` / ``nf4`` / ``fp4`` on the upload
    and the download (``down:nf4``: the download only), with error feedback unless the SPEC ends in ``-noef``."""
    direction, _, spec = spec.rpartition(":")
    kind, _, flag = spec.partition("-")
    return {"upload": "none" if direction == "down" else kind, "download": kind, "error_feedback": flag != "noef"}


def run_one(strategy: str, args: dict, seed: int, data_dir: Path, opts: argparse.Namespace,
            compression: dict | None = None) -> list[dict]:
    """One federated run driven round by round; returns per-round metrics."""
    federation = {"num_clients": 4, "clients_per_round": 4, "rounds": opts.rounds, "strategy": strategy,
                  "strategy_args": {**args, **({"tau": opts.tau} if strategy == "fedloru" else {})},
                  "partition": {"method": "dirichlet", "beta": opts.beta, "column": "category", "min_size": 8},
                  **({"compression": compression} if compression else {})}
    tag = "-".join(str(v) for v in (compression or {}).values())
    raw = task_recipe(data_dir, f"run-{strategy}{tag}-{seed}", seed, federation,
                      {"local_steps": opts.local_steps, "batch_size": opts.batch_size, "lr": opts.lr,
                       "lr_schedule": "cosine", "min_lr": opts.lr / 10, "optimizer_state": "per_client",
                       "dtype": opts.dtype}, model={"name": "minilm-l6", "dtype": opts.dtype})
    fed = build_federation(parse_recipe(raw))
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False)
    model, pad = fed.loaded.model, fed.loaded.tokenizer.pad_token_id
    w0 = layer_weights(model) if not opts.all else None
    rows = []
    for rnd in range(1, opts.rounds + 1):
        record = loop.run_round(rnd, None)
        row = {"round": rnd, "train_loss": record["train_loss"], "bytes_up": record["bytes_up_total"],
               "bytes_down": record["bytes_down_total"], "seconds": record["seconds"]}
        if not opts.all or rnd == opts.rounds:  # --all: one evaluation, after the last round
            row["eval_loss"], row["accuracy"] = evaluate(model, fed.data.eval_examples, pad)
        if w0 is not None:
            now = layer_weights(model)
            ranks = [numerical_rank(now[n] - w0[n], rtol=1e-3) for n in w0]
            row["rank"] = sum(ranks) / len(ranks)
        rows.append(row)
    return rows


def summarize(results: dict[str, list[list[dict]]], rounds: int) -> str:
    def ms(values):
        return f"{statistics.mean(values):.3f} ± {statistics.pstdev(values):.3f}"

    lines = ["| method | final acc | best acc | acc @ round 3 | final eval loss | final train loss | rank of W̃−W0 (r=8) |",
             "|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        final = [r[-1] for r in runs]
        lines.append(f"| {name} | {ms([f['accuracy'] for f in final])} | {ms([max(x['accuracy'] for x in r) for r in runs])}"
                     f" | {ms([r[min(2, rounds - 1)]['accuracy'] for r in runs])} | {ms([f['eval_loss'] for f in final])}"
                     f" | {ms([f['train_loss'] for f in final])} | {statistics.mean(f['rank'] for f in final):.1f} |")
    return "\n".join(lines)


def summarize_all(results: dict[str, list[list[dict]]]) -> str:
    """Every method side by side: final accuracy and losses, bytes per round, seconds per run (mean ± std)."""
    def ms(values, fmt=".3f"):
        return f"{statistics.mean(values):{fmt}} ± {statistics.pstdev(values):{fmt}}"

    lines = ["| strategy | final acc | final eval loss | final train loss | MB up / round | MB down / round | s / run |",
             "|---|---|---|---|---|---|---|"]
    order = sorted(results, key=lambda n: -statistics.mean(r[-1]["accuracy"] for r in results[n]))
    for name in order:
        runs = results[name]
        final = [r[-1] for r in runs]
        up = [statistics.mean(x["bytes_up"] for x in r) / 1e6 for r in runs]
        down = [statistics.mean(x["bytes_down"] for x in r) / 1e6 for r in runs]
        secs = [sum(x["seconds"] for x in r) for r in runs]
        lines.append(f"| `{name}` | {ms([f['accuracy'] for f in final])} | {ms([f['eval_loss'] for f in final])} | "
                     f"{ms([f['train_loss'] for f in final])} | {statistics.mean(up):.3f} | {statistics.mean(down):.3f} | "
                     f"{ms(secs, '.1f')} |")
    return "\n".join(lines)


def plot_all(results: dict[str, list[list[dict]]], path: Path) -> None:
    """Training loss per round, and final accuracy, bytes per round and seconds per run per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(results, key=lambda n: -statistics.mean(r[-1]["accuracy"] for r in results[n]))
    fig, axes = plt.subplots(1, 4, figsize=(22, 5))
    cmap = plt.get_cmap("tab20")
    for i, name in enumerate(names):
        runs = results[name]
        rounds = [row["round"] for row in runs[0]]
        per_round = list(zip(*[[row["train_loss"] for row in run] for run in runs], strict=True))
        axes[0].plot(rounds, [statistics.mean(v) for v in per_round], label=name, color=cmap(i % 20), marker="o",
                     markersize=3)
    y = range(len(names))

    def bars(ax, values, title, log=False):
        means = [statistics.mean(v) for v in values]
        errs = [statistics.pstdev(v) for v in values]
        ax.barh(list(y), means, xerr=errs, color=[cmap(i % 20) for i in y])
        ax.set_yticks(list(y), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title)
        if log:
            ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")

    bars(axes[1], [[r[-1]["accuracy"] for r in results[n]] for n in names], "final held-out accuracy")
    bars(axes[2], [[statistics.mean(x["bytes_up"] + x["bytes_down"] for x in r) / 1e6 for r in results[n]]
                   for n in names], "MB up + down per round (all clients)", log=True)
    bars(axes[3], [[sum(x["seconds"] for x in r) for r in results[n]] for n in names], "seconds per run")
    axes[0].set_title("clients' training loss")
    axes[0].set_xlabel("round")
    axes[0].grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def plot(results: dict[str, list[list[dict]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name, runs in results.items():
        rounds = [row["round"] for row in runs[0]]
        for ax, key in zip(axes, ("train_loss", "eval_loss", "accuracy", "rank"), strict=True):
            per_round = list(zip(*[[row[key] for row in run] for run in runs], strict=True))
            mean = [statistics.mean(v) for v in per_round]
            ax.plot(rounds, mean, label=name, marker="o", markersize=3)
            ax.fill_between(rounds, [min(v) for v in per_round], [max(v) for v in per_round], alpha=0.15)
    for ax, title in zip(axes, ("clients' training loss", "global held-out loss", "global held-out accuracy",
                                "mean rank of W̃ − W0 per layer"), strict=True):
        ax.set_title(title)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[3].axhline(8, color="grey", linestyle=":", linewidth=1)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--local-steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.1, help="Dirichlet concentration (smaller = more skew)")
    parser.add_argument("--tau", type=int, default=2, help="FedLoRU's accumulation cycle")
    parser.add_argument("--methods", nargs="+", default=None,
                        help="names from the FRLoRA comparison (default: all of them), or registry names with --all")
    parser.add_argument("--all", action="store_true",
                        help="every registered strategy with a global model, side by side (see the docstring)")
    parser.add_argument("--plot", default=None, help="default: docs/repro_small.png (docs/baselines_small.png with --all)")
    parser.add_argument("--strategy-args", type=json.loads, default={},
                        help='JSON merged into every method\'s strategy_args, e.g. \'{"client_ranks": "uniform"}\'')
    parser.add_argument("--compression", nargs="+", default=None, metavar="SPEC",
                        help="FedAvg with each federation.compression SPEC instead (none, int8, nf4, fp4 on upload and "
                             "download; a -noef suffix turns error feedback off), reported as --all reports")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="train.dtype and model.dtype of every run (auto, fedllm's default: bf16 on a CPU with "
                             "avx512_bf16/AMX, else fp32)")
    parser.add_argument("--compression-strategies", nargs="+", default=["fedavg"], metavar="NAME",
                        help="the strategies each --compression SPEC runs with, NAME or NAME:JSON of its "
                             "strategy_args (default: fedavg)")
    add_task_arguments(parser, 400, 200)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    methods = global_methods() if opts.all else METHODS
    if opts.compression:
        named = [n.partition(":") for n in opts.compression_strategies]  # NAME or NAME:JSON (its strategy_args)
        methods = {f"{'FedAvg' if name == 'fedavg' else name} {spec}": (
            name, {"weighting": "uniform", **json.loads(extra or "{}")}, compression_section(spec))
            for name, _, extra in named for spec in opts.compression}
        opts.all = True  # one evaluation after the last round, the side-by-side table with bytes
    unknown = [m for m in opts.methods or [] if m not in methods]
    if unknown:
        parser.error(f"--methods {' '.join(unknown)}: not among {', '.join(methods)}")
    opts.methods = opts.methods or list(methods)
    opts.plot = opts.plot or ("docs/baselines_small.png" if opts.all else "docs/repro_small.png")
    results: dict[str, list[list[dict]]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_splits(data_dir, opts.train, opts.test)
        for name in opts.methods:
            strategy, args, *compression = methods[name]
            args = {**args, **opts.strategy_args}
            results[name] = []
            for seed in opts.seeds:
                t = time.perf_counter()
                results[name].append(run_one(strategy, args, seed, data_dir, opts, *compression))
                last = results[name][-1][-1]
                rank = f" rank {last['rank']:.1f}" if "rank" in last else ""
                print(f"{name:>18} seed {seed}: acc {last['accuracy']:.3f} loss {last['eval_loss']:.3f}{rank} "
                      f"({time.perf_counter() - t:.0f}s)", flush=True)
    print(f"\n{len(opts.seeds)} seeds, {opts.rounds} rounds, --dtype {opts.dtype}, {time.perf_counter() - start:.0f}s"
          " in all\n")
    print(summarize_all(results) if opts.all else summarize(results, opts.rounds))
    if opts.plot:
        (plot_all if opts.all else plot)(results, Path(opts.plot))
        print(f"\nplot: {opts.plot}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "results": results}, indent=1))


if __name__ == "__main__":
    main()
