"""SecAgg+ (``privacy.secure_aggregation: secagg_plus``) against the plain upload: round time and bytes per client,
measured side by side (not a test).

Each trial runs the same federated recipe twice in this process, once plain and once with SecAgg+ (order
alternating between trials): the model of ``--model`` with LoRA ``--lora-r`` on q/v, ``--per-round`` of
``--clients`` clients (IID split of the synthetic arithmetic problems of ``data_prep/make_arith.py``), FedAvg,
``--rounds`` rounds of ``--local-steps`` AdamW steps of ``--batch`` × ``--max-length`` tokens; no evaluation or
intermediate checkpoints. Round seconds are the round loop's own (``metrics.jsonl``'s ``seconds``: sampling,
training, the protocol, aggregation; not the model load). Bytes per client are what a client uploads in a round:
plain, its adapter in ``federation.comm_dtype``; SecAgg+, its masked words plus its protocol messages (public keys,
encrypted shares, the signed survivor list, revealed shares) — and the protocol's download (neighbours' keys,
shares routed to it, the survivors' signatures).
The secure run's protocol alone is also timed (``SecureRound``'s key exchange, masking and unmasking).

    python bench/secagg.py --model tiny-llama --clients 8 --per-round 8 --rounds 3 --trials 5
    python bench/secagg.py --model smollm2-135m-instruct --clients 10 --per-round 5 --rounds 2 --trials 3 \\
        --local-steps 6 --batch 4 --max-length 96 --lora-r 8

With ``--flower loopback`` both runs go through fedllm's Flower apps in this process: the ServerApp's executor and
the real ClientApp (tests/test_flower_apps.py's loopback grid, no network; every node signs its SecAgg+ keys with a
node key and verifies its neighbours'): the protocol's stages as Flower messages and records. With ``--flower
deployment`` they run on a real SuperLink with one ``fedllm flower supernode`` per client on 127.0.0.1 (``--insecure``:
no TLS, so the SecAgg+ keys are not signed; bench/scaling.py's loopback federation), the plain and the SecAgg+ recipe
alternating on the same federation (round 1 is left out of the medians: it includes the workers building the model).

    python bench/secagg.py --flower loopback --model smollm2-135m-instruct --clients 5 --per-round 5 --rounds 2 \
        --trials 2 --local-steps 6 --batch 4 --max-length 96 --lora-r 8 --neighbours 4
    python bench/secagg.py --flower deployment --model tiny-llama --clients 4 --per-round 4 --rounds 3 --trials 3 \
        --neighbours 3

Prints one line per trial and the medians (docs/privacy.md has the figures).
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

from fedllm.data.synthetic import arith_splits
from fedllm.engine import secure_rounds
from fedllm.engine.server import run
from fedllm.recipe.checks import parse_recipe


def recipe(args: argparse.Namespace, data: Path, out: Path, secure: bool) -> dict:
    raw = {
        "seed": 0,
        "output_dir": str(out),
        "model": {"name": args.model},
        "lora": {"r": args.lora_r, "alpha": 2 * args.lora_r},
        "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question", "output": "answer"}},
        "federation": {
            "num_clients": args.clients,
            "clients_per_round": args.per_round,
            "rounds": args.rounds,
            "strategy": "fedavg",
            "partition": {"method": "iid"},
        },
        "train": {
            "local_steps": args.local_steps,
            "batch_size": args.batch,
            "lr": 1e-3,
            "max_length": args.max_length,
            "threads": args.threads,
        },
        "eval": {"tasks": []},
        "checkpoint": {"every": 0},
        "logging": {"progress": False, "quiet": True},
    }
    if secure:
        raw["privacy"] = {
            "secure_aggregation": "secagg_plus",
            "secagg": {"max_dropouts": args.max_dropouts, "neighbours": args.neighbours},
            "per_client_stats": True,  # the bench reads each client's bytes (docs/privacy.md)
        }
    return raw


class ProtocolClock:
    """Seconds spent in the protocol's steps (key/share exchange, masking, unmasking), patched around them: the
    simulation's ``SecureRound``, and on Flower the ServerApp's stages (``FlowerSecureRound``: they include the
    nodes' answers, in process) and the nodes' masking."""

    def __init__(self, flower: bool = False) -> None:
        self.seconds = 0.0
        for name in ("__init__", "mask", "finish"):
            self.wrap(secure_rounds.SecureRound, name)
        if flower:
            from fedllm.flower import secagg_stages

            for owner, name in ((secagg_stages.FlowerSecureRound, "__init__"),
                                (secagg_stages.FlowerSecureRound, "finish"), (secagg_stages, "masked_update")):
                self.wrap(owner, name)

    def wrap(self, owner, name: str) -> None:
        original = getattr(owner, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)


def loopback_executor(args, root: Path):
    """fedllm's Flower ServerApp executor over an in-process grid of the real ClientApp (one node per client, each
    with a node key that signs its SecAgg+ keys)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flwr.supercore.task_identity import TaskIdentity

    from fedllm.flower.certs import write_node_keys
    from fedllm.flower.executor import FlowerExecutor
    from fedllm.flower.server_app import read_node_keys
    from tests.test_flower_apps import LoopbackGrid

    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = 1, 1, 1
    keys = root / "node-keys"
    if not keys.is_dir():
        write_node_keys(keys, args.clients)
    nodes = [{"partition-id": c, "state-dir": str(root / f"node{c}"), "node-key": str(keys / f"client-{c}.key"),
              "peer-keys": str(keys)} for c in range(args.clients)]
    return FlowerExecutor(LoopbackGrid(nodes), node_keys=read_node_keys(str(keys)))


def rounds_of(history: list[dict], skip_first: bool) -> list[dict]:
    return [h for h in history if h.get("round", 0) > (1 if skip_first else 0)]


def summary(rounds: list[dict], secure: bool, protocol_seconds: float | None) -> dict:
    """Median round seconds and bytes of a run's rounds (and the SecAgg+ figures of a secure run)."""
    up = [b for h in rounds for b in h["bytes_up"].values()]
    out = {"round_seconds": statistics.median(h["seconds"] for h in rounds), "bytes_up": statistics.median(up),
           "down": statistics.median(b for h in rounds for b in h["bytes_down"].values())}
    if secure:
        info = rounds[-1]["secure_aggregation"]
        out.update(
            protocol_seconds_per_round=protocol_seconds,
            plain_bytes=info["plain_bytes_per_client"],
            masked_bytes=info["masked_bytes_per_client"],
            protocol_up=statistics.median(int(b) for b in info["protocol_bytes_up"].values()),
            clipped=info["clipped_values"],
            mod_bits=info["mod_bits"],
            step=info["quantization_step"],
        )
    return out


def deployment_trials(args, data: Path, root: Path) -> list[dict]:
    """Plain and SecAgg+ runs alternating (plain, secure, secure, plain, ...) on one real loopback federation."""
    import os

    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from scaling import ROOT, flower_run

    path = root / "recipe.yaml"
    order = [i % 4 in (1, 2) for i in range(2 * args.trials)]

    def write(i: int) -> None:
        path.write_text(yaml.safe_dump(recipe(args, data, root / f"unused-{i}", order[i])))

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    write(0)
    outs = flower_run(path, [], args.clients, root, env, 3600, repeats=len(order), between=write)
    runs = []
    for secure, out in zip(order, outs, strict=True):
        history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        runs.append((secure, summary(rounds_of(history, skip_first=True), secure, None)))
    return [{"plain" if not s else "secure": r for s, r in runs[2 * t: 2 * t + 2]} for t in range(args.trials)]


def one_run(args, data, root, secure, clock) -> dict:
    before = clock.seconds
    raw = parse_recipe(recipe(args, data, root / ("secure" if secure else "plain"), secure))
    executor = loopback_executor(args, root / ("secure-nodes" if secure else "plain-nodes")) if args.flower else None
    result = run(raw, overwrite=True, executor=executor)
    rounds = [h for h in result.history if h.get("round", 0) > 0]
    if args.flower:
        return summary(rounds, secure, (clock.seconds - before) / len(rounds) if secure else None)
    up = [b for h in rounds for b in h["bytes_up"].values()]
    out = {"round_seconds": statistics.median(h["seconds"] for h in rounds), "bytes_up": statistics.median(up)}
    if secure:
        info = rounds[-1]["secure_aggregation"]
        out.update(
            protocol_seconds_per_round=(clock.seconds - before) / len(rounds),
            plain_bytes=info["plain_bytes_per_client"],
            masked_bytes=info["masked_bytes_per_client"],
            protocol_up=statistics.median(int(b) for b in info["protocol_bytes_up"].values()),
            down=statistics.median(b for h in rounds for b in h["bytes_down"].values()),
            clipped=info["clipped_values"],
            mod_bits=info["mod_bits"],
            step=info["quantization_step"],
        )
    else:
        out["down"] = statistics.median(b for h in rounds for b in h["bytes_down"].values())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--per-round", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--lora-r", type=int, default=8)
    p.add_argument("--neighbours", type=int, default=8)
    p.add_argument("--max-dropouts", type=int, default=1)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--train", type=int, default=400, help="training problems (split over the clients)")
    p.add_argument("--json", help="write the trials and medians here")
    p.add_argument("--work", help="keep the runs and logs in this directory (default: a temporary one)")
    p.add_argument("--flower", choices=["loopback", "deployment"],
                   help="through fedllm's Flower apps in process (loopback) or a real SuperLink and SuperNodes")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = ProtocolClock(args.flower == "loopback")
    trials = []
    with tempfile.TemporaryDirectory(prefix="fedllm-secagg-bench-") as tmp:
        root = Path(args.work or tmp)
        root.mkdir(parents=True, exist_ok=True)
        data = root / "arith.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in arith_splits(args.train, 10, 0)[0]))
        deployed = deployment_trials(args, data, root) if args.flower == "deployment" else None
        for trial in range(args.trials):
            order = (False, True) if trial % 2 == 0 else (True, False)
            if deployed is not None:
                got = deployed[trial]
                got["secure"]["protocol_seconds_per_round"] = float("nan")  # not measured across processes
            else:
                got = {("secure" if s else "plain"): one_run(args, data, root, s, clock) for s in order}
            got["ratio_seconds"] = got["secure"]["round_seconds"] / got["plain"]["round_seconds"]
            got["ratio_bytes_up"] = got["secure"]["bytes_up"] / got["plain"]["bytes_up"]
            trials.append(got)
            print(
                f"trial {trial + 1}: round s plain {got['plain']['round_seconds']:.3f} secure "
                f"{got['secure']['round_seconds']:.3f} (x{got['ratio_seconds']:.3f}; protocol "
                f"{got['secure']['protocol_seconds_per_round']:.3f} s/round); bytes up plain "
                f"{got['plain']['bytes_up']:.0f} secure {got['secure']['bytes_up']:.0f} "
                f"(x{got['ratio_bytes_up']:.4f}: masked {got['secure']['masked_bytes']}, protocol "
                f"{got['secure']['protocol_up']}); down plain {got['plain']['down']:.0f} secure "
                f"{got['secure']['down']:.0f}",
                flush=True,
            )
    med = {k: statistics.median(t[k] for t in trials) for k in ("ratio_seconds", "ratio_bytes_up")}
    med.update(
        {
            f"{side}_{k}": statistics.median(t[side][k] for t in trials)
            for side in ("plain", "secure")
            for k in ("round_seconds", "bytes_up", "down")
        }
    )
    med["secure_protocol_seconds_per_round"] = statistics.median(
        t["secure"]["protocol_seconds_per_round"] for t in trials
    )
    print("median: " + json.dumps(med))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "trials": trials, "median": med}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
