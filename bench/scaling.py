"""Scaling: one recipe in one process, in two processes, and over Flower on loopback; gathers of large adapters.

    python bench/scaling.py [--recipe recipes/frlora/tiny-llama-arith-frlora.yaml] [--rounds 2]
                            [--gather-mb 64] [--no-flower]
    python bench/scaling.py --interleave 3 [--recipe R] [--rounds 3] [OVERRIDE ...]

Prints, for the same recipe and seed:

- seconds per round and bytes moved per round with 1 process (in process) and 2 processes (torchrun,
  gloo on CPU; NCCL when GPUs are visible), and the ratio;
- the same recipe over Flower's deployment engine on 127.0.0.1 (a SuperLink and one SuperNode per
  client, started and stopped here) vs in process: seconds per round and the overhead ratio, and the
  bytes each reports (Flower's catch-up sends what a node missed; the simulation counts broadcasts);
- the all-gather of a ``--gather-mb`` MB adapter per process between 2 processes: pickled
  ``all_gather_object`` (what fedllm did before) vs one ``all_gather`` of a uint8 buffer (what
  :meth:`fedllm.engine.distributed.Dispatch.gather` does now).

With ``--interleave N``: N in-process runs alternating with N Flower runs on one loopback federation
(SuperLink + one ``fedllm flower supernode`` per client, node workers on), so both see the same machine
load; prints each run's first round (a Flower run's includes the workers building the model) and its later
rounds separately, and the ratio of the medians of the later rounds.

Every subprocess has a deadline. The figures depend on the machine; the README quotes one run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def per_round(run_dir: Path) -> dict[str, float]:
    """Mean seconds and bytes (up + down) per round of a finished run."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("round", 0) > 0]
    return {"seconds": sum(r["seconds"] for r in rows) / len(rows),
            "bytes": sum(r["bytes_up_total"] + r["bytes_down_total"] for r in rows) / len(rows),
            "loss": rows[-1]["train_loss"]}


def fedllm(args: list[str], env: dict, timeout: float, log: Path | None = None, launcher: list[str] | None = None):
    cmd = (launcher or [sys.executable, "-m"]) + ["fedllm", *args]
    out = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.run(cmd, env=env, timeout=timeout, stdout=out, stderr=subprocess.STDOUT, check=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


KINDS = (("fedllm.flower.superlink", "SuperLink"), ("runtime serverapps", "ServerApps"),
         ("fedllm.flower.supernode", "SuperNodes"), ("runtime clientapps", "workers"),
         ("fedllm flower", "fedllm supervisors"))
"""Which process of a deployment a command line is (first match): the per-process CPU that --interleave prints."""


def kind_of(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    return next((name for mark, name in KINDS if mark in cmd), "other")


def tree_cpu_by_kind(pids: list[int]) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes ``pids`` and every live descendant, with the
    children each of them has already collected (a finished ServerApp is collected by its runner), by
    :data:`KINDS`."""
    tick = os.sysconf("SC_CLK_TCK")
    kids: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(stat.parent.name)
        stats[pid] = fields
        kids.setdefault(int(fields[1]), []).append(pid)
    total: dict[str, float] = {}
    todo, seen = list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        kind = kind_of(pid)
        total[kind] = total.get(kind, 0.0) + sum(int(x) for x in stats[pid][11:15]) / tick  # u/s time, cu/cs time
        todo.extend(kids.get(pid, []))
    return total


def tree_cpu(pids: list[int]) -> float:
    """CPU seconds of ``pids`` and their descendants (:func:`tree_cpu_by_kind`, summed)."""
    return sum(tree_cpu_by_kind(pids).values())


def children_cpu() -> float:
    """CPU seconds of this process's finished, collected children."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def rounds_of(run_dir: Path) -> list[float]:
    """Seconds of each round of a finished run."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r["seconds"] for r in rows if r.get("round", 0) > 0]


def flower_run(recipe: Path, overrides: list[str], num_clients: int, work: Path, env: dict, timeout: float,
               repeats: int = 1, between=None, cpu: list[float] | None = None,
               cpu_kinds: list[dict[str, float]] | None = None, node_superlink=None) -> list[Path]:
    """Run ``recipe`` ``repeats`` times over one loopback SuperLink with one SuperNode per client (calling
    ``between(i)`` before run ``i``); return the run directories (and append each run's CPU seconds, of every
    process of the deployment and of ``fedllm flower run``, to ``cpu``, and by process kind to ``cpu_kinds``).
    ``node_superlink(client, superlink_port)`` gives the address client's SuperNode connects to (bench/wan_rounds.py:
    a WAN proxy's); default the SuperLink's."""
    port = free_port()
    env = {**env, "FLWR_HOME": str(work / "flwr-home")}
    procs = []

    def start(args, name):
        log = open(work / f"{name}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "fedllm", "flower", *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start(["superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port), "--runs-dir", str(work)], "superlink")
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("SuperLink did not start") from None
                time.sleep(0.3)
        for cid in range(num_clients):
            address = node_superlink(cid, port) if node_superlink is not None else f"127.0.0.1:{port}"
            start(["supernode", "--superlink", address, "--client", str(cid), "--insecure",
                   "--state-dir", str(work / "state"), "--port", str(free_port())], f"supernode{cid}")
        outs = []
        for i in range(repeats):
            if between is not None:
                between(i)
            out = work / f"flower-run-{i}"
            before, client_before = tree_cpu_by_kind([p.pid for p in procs]), children_cpu()
            fedllm(["flower", "run", str(recipe), *overrides, f"output_dir={out}", "--superlink",
                    f"127.0.0.1:{port}", "--insecure", "--timeout", str(timeout)], env, timeout, work / f"flower-run-{i}.log")
            after = tree_cpu_by_kind([p.pid for p in procs])
            spent = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            spent["fedllm flower run + flwr"] = children_cpu() - client_before
            if cpu is not None:
                cpu.append(sum(spent.values()))
            if cpu_kinds is not None:
                cpu_kinds.append(spent)
            outs.append(out)
        return outs
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)


def gather_worker(mb: float, repeats: int) -> None:
    """Run under torchrun: time both all-gathers of a ``mb`` MB state per process (rank 0 prints JSON)."""
    import torch
    import torch.distributed as dist

    from fedllm.engine.distributed import Dispatch
    from fedllm.strategies.base import ClientUpdate

    dispatch = Dispatch()
    numel = int(mb * 2**20 / 4)
    state = {f"layer{i}.lora_A": torch.randn(numel // 8) for i in range(8)}
    times = {"pickled_all_gather_object": [], "tensor_all_gather": []}
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        parts = [None] * dispatch.world
        dist.all_gather_object(parts, [ClientUpdate(dispatch.rank, state, 1, 0.0, 1)])
        times["pickled_all_gather_object"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dispatch.gather([ClientUpdate(dispatch.rank, dict(state), 1, 0.0, 1)], {}, {})
        times["tensor_all_gather"].append(time.perf_counter() - t0)
    if dispatch.is_main:
        print(json.dumps({k: min(v) for k, v in times.items()}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(ROOT / "recipes/frlora/tiny-llama-arith-frlora.yaml"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gather-mb", type=float, default=64.0)
    ap.add_argument("--no-flower", action="store_true", help="skip the Flower loopback run")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--interleave", type=int, default=0, help="N in-process runs alternating with N Flower runs")
    ap.add_argument("--keep", help="with --interleave: keep the runs and the deployment's logs in this new directory")
    ap.add_argument("overrides", nargs="*", help="dotted.key=value recipe overrides (with --interleave)")
    ap.add_argument("--gather-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.gather_worker:
        gather_worker(args.gather_mb, repeats=3)
        return
    if args.interleave:
        interleave(args)
        return

    from fedllm.recipe.checks import load_recipe

    recipe = Path(args.recipe).resolve()
    overrides = [f"federation.rounds={args.rounds}", "logging.progress=false", "logging.quiet=true"]
    num_clients = load_recipe(recipe, overrides).federation.num_clients
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                str(free_port()), "-m"]
    with tempfile.TemporaryDirectory(prefix="fedllm-scaling-") as tmp:
        work = Path(tmp)
        results = {}
        for name, launcher in (("1 process", None), ("2 processes", torchrun)):
            out = work / name.replace(" ", "-")
            fedllm(["train", str(recipe), *overrides, f"output_dir={out}"], env, args.timeout, launcher=launcher)
            results[name] = per_round(out)
        if not args.no_flower:
            results["Flower loopback"] = per_round(flower_run(recipe, overrides, num_clients, work, env,
                                                              args.timeout)[0])
        base = results["1 process"]
        print(f"recipe {recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe}, "
              f"{args.rounds} rounds, {num_clients} clients")
        print(f"{'':16s} {'s/round':>9s} {'ratio':>7s} {'bytes/round':>12s} {'final loss':>11s}")
        for name, r in results.items():
            print(f"{name:16s} {r['seconds']:9.3f} {r['seconds'] / base['seconds']:7.2f} {r['bytes']:12.0f} "
                  f"{r['loss']:11.6f}")
        gather = subprocess.run([*torchrun, "bench.scaling", "--gather-worker", "--gather-mb", str(args.gather_mb)],
                                env={**env, "PYTHONPATH": env["PYTHONPATH"] + os.pathsep + str(ROOT)}, cwd=ROOT,
                                capture_output=True, text=True, timeout=args.timeout, check=True)
        times = json.loads(gather.stdout.strip().splitlines()[-1])
        print(f"all-gather of {args.gather_mb:g} MB per process, 2 processes (best of 3):")
        for k, v in times.items():
            print(f"  {k:26s} {v:8.3f} s")


def interleave(args: argparse.Namespace) -> None:
    """In-process and Flower runs of one recipe, alternating, on the same machine load."""
    import statistics

    from fedllm.recipe.checks import load_recipe

    recipe = Path(args.recipe).resolve()
    overrides = [f"federation.rounds={args.rounds}", "logging.progress=false", "logging.quiet=true",
                 *args.overrides]
    num_clients = load_recipe(recipe, overrides).federation.num_clients
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    from contextlib import nullcontext

    if args.keep:
        Path(args.keep).mkdir(parents=True)
    with nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="fedllm-interleave-") as tmp:
        work = Path(tmp).resolve()
        local: list[list[float]] = []
        local_cpu: list[float] = []
        flower_cpu: list[float] = []

        def in_process(i: int) -> None:
            out = work / f"local-{i}"
            before = children_cpu()
            fedllm(["train", str(recipe), *overrides, f"output_dir={out}"], env, args.timeout)
            local_cpu.append(children_cpu() - before)
            local.append(rounds_of(out))

        kinds: list[dict[str, float]] = []
        flower = [rounds_of(d) for d in flower_run(recipe, overrides, num_clients, work, env, args.timeout,
                                                   repeats=args.interleave, between=in_process, cpu=flower_cpu,
                                                   cpu_kinds=kinds)]
    print(f"recipe {recipe.relative_to(ROOT) if recipe.is_relative_to(ROOT) else recipe} {' '.join(args.overrides)}, "
          f"{args.rounds} rounds, {num_clients} clients, {args.interleave} runs each, interleaved")
    for name, runs, cpus in (("in process", local, local_cpu), ("Flower+workers", flower, flower_cpu)):
        for i, (r, c) in enumerate(zip(runs, cpus)):
            print(f"  {name:15s} run {i}: round 1 {r[0]:8.2f} s, later rounds " + " ".join(f"{x:.2f}" for x in r[1:])
                  + f"; CPU {c:.0f} s")
    later = {name: statistics.median(x for r in runs for x in r[1:]) for name, runs in
             (("in process", local), ("Flower+workers", flower))}
    print(f"median of rounds >= 2: in process {later['in process']:.3f} s, Flower {later['Flower+workers']:.3f} s, "
          f"ratio {later['Flower+workers'] / later['in process']:.2f}")
    cpu = {"in process": statistics.median(local_cpu), "Flower": statistics.median(flower_cpu[1:] or flower_cpu)}
    print(f"median CPU per run (Flower: runs after the first, whose workers build the model): in process "
          f"{cpu['in process']:.0f} s, Flower {cpu['Flower']:.0f} s, ratio {cpu['Flower'] / cpu['in process']:.2f}")
    for i, spent in enumerate(kinds):
        print(f"  Flower run {i} CPU by process: " + ", ".join(f"{k} {v:.1f} s" for k, v in sorted(
            spent.items(), key=lambda kv: -kv[1]) if v >= 0.05))
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
