"""CPU threading options, idle and with one competing CPU-bound process.

    python bench/cpu_threads.py [--workloads tiny,smollm2-shapes] [--options before,passive,spin1k,...]
                                [--trials 2] [--budget 170]

Each trial is a fresh subprocess (OpenMP reads its variables when torch loads) with
one option's environment, on an idle machine and then with ``python3 -c "while True:
pass"`` running beside it (started and killed by the bench). Trials are interleaved
(option by option, round robin) so drift of the machine hits every option alike; the
whole bench stops starting trials after ``--budget`` seconds.

Workloads:

- ``tiny``: ``fedllm.engine.server.run`` on the tiny-llama preset, FedAvg, 2 clients x 30
  local steps, batch 4, 4 rounds; s/round = median of rounds 2-4.
- ``smollm2-shapes``: the quickstart's compute without loading the GGUF: a LLaMA with
  SmolLM2-135M's shapes (random weights), LoRA r=8 on q/k/v/o, AdamW, batch 4 x 96
  tokens; s/round = 12 x (seconds per optimizer step over ``--steps`` steps after one
  warm-up), the quickstart's 2 clients x 6 steps.

Options: ``before`` (no variable: torch's default), ``passive`` (OMP_WAIT_POLICY=PASSIVE),
``spinN`` (GOMP_SPINCOUNT=N, e.g. spin10000), ``t1`` (OMP_NUM_THREADS=1), ``idlecores``
(threads = cores idle over 0.3 s at start-up), ``fedllm`` (fedllm.common.threads.apply(), the
shipped default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WAIT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
             "FEDLLM_THREADS", "RAYON_NUM_THREADS")


def idle_cores(window: float = 0.3) -> int:
    """Cores idle over ``window`` seconds, from /proc/stat (at least 1)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]

    total0, idle0 = sample()
    time.sleep(window)
    total1, idle1 = sample()
    busy_fraction = 1 - (idle1 - idle0) / max(1, total1 - total0)
    cores = len(os.sched_getaffinity(0))
    return max(1, cores - round(busy_fraction * cores))


def option_env(option: str) -> dict[str, str]:
    """Environment variables of one option (the child applies ``fedllm`` and ``idlecores`` itself)."""
    if option == "passive":
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    if option.startswith("spin"):
        return {"GOMP_SPINCOUNT": option[4:].replace("k", "000")}
    if option == "t1":
        return {"OMP_NUM_THREADS": "1"}
    return {}


# ----------------------------------------------------------------------------- children (one trial each)


def child_tiny(out: Path) -> list[float]:
    from fedllm.data.synthetic import generate_arith
    from fedllm.engine.server import run
    from fedllm.recipe.checks import parse_recipe

    data = out / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate_arith(400, seed=0)))
    recipe = parse_recipe({
        "seed": 0, "output_dir": str(out / "run"), "model": {"name": "tiny-llama"}, "lora": {"r": 8, "alpha": 16},
        "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 4, "partition": {"method": "iid"}},
        "train": {"local_steps": 30, "batch_size": 4, "lr": 1e-3, "max_length": 64},
        "logging": {"progress": False, "quiet": True}})
    history = run(recipe).history
    return [h["seconds"] for h in history[1:]]


def child_smollm2_shapes(steps: int) -> list[float]:
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                                      max_position_embeddings=2048, tie_word_embeddings=True)
    model = get_peft_model(transformers.LlamaForCausalLM(config),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 49152, (4, 96), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return [12 * statistics.mean(times)]  # the quickstart round: 2 clients x 6 steps


def child(args: argparse.Namespace) -> None:
    if args.option == "fedllm":
        from fedllm.common import threads

        threads.apply()
    elif args.option == "idlecores":
        os.environ["OMP_NUM_THREADS"] = str(idle_cores())
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        seconds = child_tiny(Path(tmp)) if args.workload == "tiny" else child_smollm2_shapes(args.steps)
    print(json.dumps({"seconds": seconds, "threads": torch.get_num_threads()}))


# ----------------------------------------------------------------------------- parent


def trial(workload: str, option: str, steps: int, timeout: float) -> tuple[float, int]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARS}
    env.update(option_env(option), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    out = subprocess.run([sys.executable, __file__, "--child", "--workload", workload, "--option", option,
                          "--steps", str(steps)], capture_output=True, text=True, env=env, timeout=timeout,
                         cwd=Path(__file__).resolve().parents[1])
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return statistics.median(result["seconds"]), result["threads"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="tiny,smollm2-shapes")
    p.add_argument("--options", default="before,passive,spin10k,t1,idlecores,fedllm")
    p.add_argument("--scenarios", default="idle,busy")
    p.add_argument("--trials", type=int, default=2, help="interleaved trials per option and scenario")
    p.add_argument("--steps", type=int, default=3, help="smollm2-shapes: timed optimizer steps per trial")
    p.add_argument("--budget", type=float, default=170.0, help="seconds after which no new trial starts")
    p.add_argument("--trial-timeout", type=float, default=120.0, help="seconds after which a trial counts as '>'")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    p.add_argument("--option", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    start = time.perf_counter()
    options = args.options.split(",")
    results: dict[tuple[str, str, str], list[float]] = {}
    threads_used: dict[tuple[str, str, str], int] = {}
    print(f"load average at start: {os.getloadavg()}; usable cores: {len(os.sched_getaffinity(0))}", flush=True)
    for workload in args.workloads.split(","):
        for scenario in args.scenarios.split(","):
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if scenario == "busy" else None
            try:
                for t in range(args.trials):
                    for option in options:
                        if time.perf_counter() - start > args.budget:
                            break
                        try:
                            s, n = trial(workload, option, args.steps, timeout=args.trial_timeout)
                        except subprocess.TimeoutExpired:
                            s, n = float("inf"), 0  # slower than the bound: shown as "> bound"
                        results.setdefault((workload, scenario, option), []).append(s)
                        threads_used[(workload, scenario, option)] = n
                        print(f"{workload:15s} {scenario:5s} {option:10s} trial {t + 1}: {s:7.2f} s/round "
                              f"({n} threads)", flush=True)
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
    print(f"\nload average at end: {os.getloadavg()}; wall {time.perf_counter() - start:.0f} s")
    print("\n| workload | option | idle s/round | busy s/round | busy / idle | idle vs before |\n|---|---|---|---|---|---|")
    for workload in args.workloads.split(","):
        base = results.get((workload, "idle", "before"))
        for option in options:
            idle, busy = results.get((workload, "idle", option)), results.get((workload, "busy", option))
            fmt = lambda xs: ", ".join(f"{x:.2f}" if x != float("inf") else f"> {args.trial_timeout:.0f} s (whole trial)"
                                       for x in xs) if xs else "—"  # noqa: E731
            ratio = f"{statistics.median(busy) / statistics.median(idle):.2f}x" if idle and busy else "—"
            vs = f"{100 * (statistics.median(idle) / statistics.median(base) - 1):+.0f}%" if idle and base else "—"
            print(f"| {workload} | {option} | {fmt(idle)} | {fmt(busy)} | {ratio} | {vs} |")


if __name__ == "__main__":
    main()
