"""Robust aggregation against one attacking client, on the small task of ``bench/repro_small.py`` (not a test).

Task and model as ``repro_small.py``: classify the operation of synthetic arithmetic problems with MiniLM-L6
+ LoRA (r=8), here split IID over ``--clients`` clients (5), all training every round. The last client is the
attacker: each round its upload is replaced by ``θ + a·(θ_k − θ)`` (θ the round's global state, θ_k what it
trained), with ``a = --scale`` (scaled, 10) or ``a = −1`` (sign-flipped). Per strategy and attack (and for FedAvg
once without an attacker) it records the held-out accuracy after the last round and, every round, the L2
distance of the new global state from the honest clients' plain mean (over every aggregated tensor), next to the
norm of the honest mean's step.

    python bench/robust_small.py --seeds 0 --rounds 3 --local-steps 2 --train 100 --test 60 --threads 1 \
        --json bench/out/robust_small.json

Bulyan needs ``n ≥ 4f + 3`` updates: with 5 clients it runs with ``f = 0`` (recursive Krum keeps all 5 and the
coordinate-wise trimming keeps all 5: the plain mean) unless ``--clients 7`` is given.
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

from fedllm.engine.server import LocalExecutor, RoundLoop, build_federation  # noqa: E402
from fedllm.recipe.checks import parse_recipe  # noqa: E402


def methods(clients: int) -> dict[str, tuple[str, dict]]:
    f_bulyan = 1 if clients >= 7 else 0
    return {"fedavg": ("fedavg", {"weighting": "uniform"}), "fedmedian": ("fedmedian", {}),
            "fedtrimmedavg (β=0.2)": ("fedtrimmedavg", {"beta": 0.2}),
            "krum (f=1)": ("krum", {"num_malicious_clients": 1}),
            "multikrum (f=1, m=3)": ("multikrum", {"num_malicious_clients": 1, "num_clients_to_select": 3}),
            f"bulyan (f={f_bulyan})": ("bulyan", {"num_malicious_clients": f_bulyan})}


class Attacked(LocalExecutor):
    """Trains as usual, then replaces the attacker's upload and keeps the honest clients' mean."""

    def __init__(self, attacker: int, factor: float):
        super().__init__()
        self.attacker, self.factor = attacker, factor
        self.honest_mean: dict[str, torch.Tensor] = {}

    def train(self, loop, rnd, sampled, lr, bar):
        updates, down, dropped = super().train(loop, rnd, sampled, lr, bar)
        g = loop.global_state
        honest = [u.state for u in updates if u.client_id != self.attacker]
        self.honest_mean = {k: torch.stack([s[k].float() for s in honest]).mean(0) for k in honest[0]}
        for u in updates:
            if u.client_id == self.attacker:
                u.state = {k: g[k] + self.factor * (v - g[k]) for k, v in u.state.items()}
        return updates, down, dropped


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.cat([(a[k].float() - b[k].float()).flatten() for k in b]).norm())


def run_one(strategy: str, args: dict, factor: float, seed: int, data_dir: Path, opts) -> dict:
    federation = {"num_clients": opts.clients, "clients_per_round": opts.clients, "rounds": opts.rounds,
                  "strategy": strategy, "strategy_args": args, "partition": {"method": "iid"}}
    raw = task_recipe(data_dir, f"run-{strategy}-{factor}-{seed}", seed, federation,
                      {"local_steps": opts.local_steps, "lr": opts.lr})
    fed = build_federation(parse_recipe(raw))
    executor = Attacked(opts.clients - 1, factor)
    loop = RoundLoop(fed, Path(raw["output_dir"]), progress=False, executor=executor)
    dists, steps = [], []
    for rnd in range(1, opts.rounds + 1):
        before = dict(loop.global_state)
        loop.run_round(rnd, None)
        dists.append(distance(loop.global_state, executor.honest_mean))
        steps.append(distance(executor.honest_mean, before))
    _, acc = evaluate(fed.loaded.model, fed.data.eval_examples, fed.loaded.tokenizer.pad_token_id)
    return {"accuracy": acc, "distance": dists, "honest_step": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=5)
    parser.add_argument("--local-steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--scale", type=float, default=10.0, help="the scaled attack's factor")
    add_task_arguments(parser, 200, 100)
    opts = parser.parse_args()
    if opts.threads:
        torch.set_num_threads(opts.threads)
    attacks = {f"scaled ×{opts.scale:g}": opts.scale, "sign-flipped": -1.0}
    results: dict[str, dict[str, list[dict]]] = {}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp)
        write_splits(data_dir, opts.train, opts.test)
        for name, (strategy, args) in methods(opts.clients).items():
            for attack, factor in ({"none": 1.0, **attacks} if strategy == "fedavg" else attacks).items():
                runs = results.setdefault(name, {}).setdefault(attack, [])
                for seed in opts.seeds:
                    runs.append(run_one(strategy, args, factor, seed, data_dir, opts))
                    print(f"{name:>22} {attack:>12} seed {seed}: acc {runs[-1]['accuracy']:.3f} "
                          f"dist {statistics.mean(runs[-1]['distance']):.4f}", flush=True)
    print(f"\n{len(opts.seeds)} seed(s), {opts.rounds} rounds, {opts.clients} clients, "
          f"{time.perf_counter() - start:.0f}s in all\n")
    header = " | ".join(f"{a}: acc / dist" for a in attacks)
    print(f"| strategy | {header} |\n|---|" + "---|" * len(attacks))
    honest = results["fedavg"].pop("none")
    print(f"(no attacker, fedavg: acc {statistics.mean(r['accuracy'] for r in honest):.3f})")
    for name, per_attack in results.items():
        cells = []
        for attack in attacks:
            runs = per_attack[attack]
            cells.append(f"{statistics.mean(r['accuracy'] for r in runs):.3f} / "
                         f"{statistics.mean(statistics.mean(r['distance']) for r in runs):.4f}")
        print(f"| `{name}` | " + " | ".join(cells) + " |")
    step = statistics.mean(statistics.mean(r["honest_step"]) for r in honest)
    print(f"\nmean norm of the honest mean's step per round (scale of the distances): {step:.4f}")
    if opts.json:
        Path(opts.json).parent.mkdir(parents=True, exist_ok=True)
        Path(opts.json).write_text(json.dumps({"options": vars(opts), "honest_fedavg": honest, "results": results},
                                              indent=1))


if __name__ == "__main__":
    main()
