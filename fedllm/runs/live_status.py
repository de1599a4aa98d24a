"""A run's live status for its operator, read from the run directory while the run writes it (any runtime).

What it shows is an allow-list of what the run directory already holds for the server: the round, the rounds'
clients (arrived, late, dropped), bytes, the released training loss, ε spent, seconds and the ETA — never the
recipe (paths, hub ids or URLs with credentials), never a per-client loss (under a privacy mechanism the run does
not write one). Where a Flower deployment runs it, the ServerApp also writes ``federation.json`` (which SuperNode
serves which client, how many are connected), which is read here too.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Optional

import yaml

FEDERATION_FILE = "federation.json"


def write_federation(run_dir: Path, serving: dict[int, int], connected: int) -> None:
    """Record the SuperNodes of a Flower run (client id -> node id, and how many are connected), atomically; only in
    a run directory fedllm has marked as its own (before that, e.g. while Flower's own loop discovers the nodes,
    nothing is written: the next round writes it)."""
    from fedllm.runs.rundir import is_run_dir

    if not is_run_dir(Path(run_dir)):
        return
    record = {"connected": int(connected), "serving": {str(c): int(n) for c, n in sorted(serving.items())},
              "updated": time.time()}
    tmp = Path(run_dir) / f".{FEDERATION_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, Path(run_dir) / FEDERATION_FILE)


def _finite(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _round_row(record: dict[str, Any]) -> dict[str, Any]:
    clients = [int(c) for c in record.get("clients", [])]
    late = [int(c) for c in record.get("late", [])]
    dropped = [int(c) for c in (record.get("dropped") or [])] if isinstance(record.get("dropped"), list) else []
    return {"round": int(record["round"]), "clients": clients, "late": late, "dropped": dropped,
            "bytes_up": int(record.get("bytes_up_total", 0)), "bytes_down": int(record.get("bytes_down_total", 0)),
            "loss": _finite(record.get("train_loss")), "epsilon": _finite(record.get("epsilon")),
            "seconds": _finite(record.get("seconds"))}


def run_status(run_dir: str | Path, now: Optional[float] = None) -> dict[str, Any]:
    """The status of the run in ``run_dir`` (see the module docstring for what it holds and leaves out).

    Raises:
        FileNotFoundError: ``run_dir`` holds no run (no ``recipe.yaml``).
    """
    run_dir = Path(run_dir)
    recipe_file = run_dir / "recipe.yaml"
    if not recipe_file.is_file():
        raise FileNotFoundError(f"{run_dir}: no run here (no recipe.yaml)")
    recipe = yaml.safe_load(recipe_file.read_text()) or {}
    federation = recipe.get("federation", {})
    total = int(federation.get("rounds", 0))
    rounds = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # the line being written
                continue
            if "round" in record:
                rounds.append(_round_row(record))
    done = rounds[-1]["round"] if rounds else 0
    finished = (run_dir / "summary.json").exists()
    seconds = [r["seconds"] for r in rounds if r["seconds"] is not None]
    eta = None if finished or not seconds else sum(seconds) / len(seconds) * max(0, total - done)
    nodes = None
    fed_file = run_dir / FEDERATION_FILE
    if fed_file.exists():
        try:
            fed = json.loads(fed_file.read_text())
            nodes = {"connected": int(fed["connected"]), "serving": len(fed["serving"]),
                     "age_s": round((now or time.time()) - float(fed["updated"]), 1)}
        except (ValueError, KeyError, TypeError):
            nodes = None
    epsilons = [r["epsilon"] for r in rounds if r["epsilon"] is not None]
    return {"run": run_dir.name, "strategy": str(federation.get("strategy", "")),
            "num_clients": int(federation.get("num_clients", 0)), "round": done, "rounds": total,
            "state": "finished" if finished else ("running" if rounds else "starting"),
            "eta_s": None if eta is None else round(eta, 1), "epsilon": epsilons[-1] if epsilons else None,
            "bytes_up": sum(r["bytes_up"] for r in rounds), "bytes_down": sum(r["bytes_down"] for r in rounds),
            "nodes": nodes, "history": rounds}


def format_status(status: dict[str, Any]) -> str:
    """The status as the terminal shows it (``fedllm flower status RUN_DIR``)."""
    head = (f"run {status['run']} ({status['strategy']}): round {status['round']}/{status['rounds']}, "
            f"{status['state']}")
    if status["eta_s"] is not None:
        head += f", ETA {status['eta_s']:.0f} s"
    if status["nodes"] is not None:
        head += (f"; SuperNodes: {status['nodes']['connected']} connected, {status['nodes']['serving']} of "
                 f"{status['num_clients']} clients served")
    if status["epsilon"] is not None:
        head += f"; epsilon spent {status['epsilon']:.3g}"
    lines = [head, f"bytes: up {status['bytes_up'] / 2**20:.2f} MiB, down {status['bytes_down'] / 2**20:.2f} MiB",
             f"{'round':>5}  {'clients':<16} {'late':<10} {'dropped':<10} {'loss':>8} {'up MiB':>8} {'down MiB':>9} "
             f"{'s':>7}"]
    for r in status["history"]:
        loss = "-" if r["loss"] is None else f"{r['loss']:.4f}"
        secs = "-" if r["seconds"] is None else f"{r['seconds']:.1f}"
        lines.append(f"{r['round']:>5}  {str(r['clients']):<16} {str(r['late'] or '-'):<10} "
                     f"{str(r['dropped'] or '-'):<10} {loss:>8} {r['bytes_up'] / 2**20:>8.3f} "
                     f"{r['bytes_down'] / 2**20:>9.3f} {secs:>7}")
    return "\n".join(lines)
