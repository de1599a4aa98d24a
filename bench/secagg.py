"""SecAgg+ (``privacy.secure_aggregation: secagg_plus``) against the plain upload: round time and bytes per client,
measured side by side (not a test).

Each trial runs the same federated recipe twice in this process, once plain and once with SecAgg+ (order
alternating between trials): the model of ``--model`` with LoRA ``--lora-r`` on q/v, ``--per-round`` of
``--clients`` clients (IID split of the synthetic arithmetic problems of ``data_prep/make_arith.py``), FedAvg,
``--rounds`` rounds of ``--local-steps`` AdamW steps of ``--batch`` × ``--max-length`` tokens; no evaluation or
intermediate checkpoints. Round seconds are the round loop's own (``metrics.jsonl``'s ``seconds``: sampling,
training, the protocol, aggregation; not the model load). Bytes per client are what a client uploads in a round:
plain, its adapter in ``federation.comm_dtype``; SecAgg+, its masked words plus its protocol messages (public keys,
encrypted shares, revealed shares) — and the protocol's download (neighbours' keys, shares routed to it).
The secure run's protocol alone is also timed (``SecureRound``'s key exchange, masking and unmasking).

    python bench/secagg.py --model tiny-llama --clients 8 --per-round 8 --rounds 3 --trials 5
    python bench/secagg.py --model smollm2-135m-instruct --clients 10 --per-round 5 --rounds 2 --trials 3 \\
        --local-steps 6 --batch 4 --max-length 96 --lora-r 8

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
        }
    return raw


class ProtocolClock:
    """Seconds spent in the protocol's steps (key/share exchange, masking, unmasking), patched around them."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("__init__", "mask", "finish"):
            self.wrap(name)

    def wrap(self, name: str) -> None:
        original = getattr(secure_rounds.SecureRound, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(secure_rounds.SecureRound, name, timed)


def one_run(args, data, root, secure, clock) -> dict:
    before = clock.seconds
    result = run(parse_recipe(recipe(args, data, root / ("secure" if secure else "plain"), secure)), overwrite=True)
    rounds = [h for h in result.history if h.get("round", 0) > 0]
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
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    clock = ProtocolClock()
    trials = []
    with tempfile.TemporaryDirectory(prefix="fedllm-secagg-bench-") as tmp:
        root = Path(tmp)
        data = root / "arith.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in arith_splits(args.train, 10, 0)[0]))
        for trial in range(args.trials):
            order = (False, True) if trial % 2 == 0 else (True, False)
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
