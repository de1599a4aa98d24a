"""Host overhead per training micro-batch: fedllm's federated round against a bare PEFT loop, interleaved.

    python bench/step_overhead.py [--trials 3] [--rounds 3] [--layers 30] [--batch 8] [--max-length 128]
                                  [--dtype fp32] [--device cpu] [--shapes PRESET] [--compile MODE] [--profile]
                                  [--json OUT]

On a GPU fedllm's loop was host-bound (docs/gpu.md): a round of SmolLM2 shapes took about as long for 8 micro-batches
of 8 x 128 tokens as of 32 x 512. This bench measures that fixed cost where compute is negligible: a deep, narrow
LLaMA built from a config (default 30 layers like SmolLM2, hidden 64, 4 heads, vocabulary 1024, random weights from
a seeded generator, fedllm's small tokenizer; ``--shapes smollm2-135m-instruct``: SmolLM2's shapes), LoRA r=8 on
q/k/v/o. Every trial is one federated run through the
entry ``bench/gpu_check.py`` uses (:func:`fedllm.engine.server.run` with an in-process
:class:`~fedllm.engine.server.LocalExecutor`; FedAvg, 4 clients, 2 per round, 4 local AdamW steps). In every
round, right after fedllm's clients trained, the same micro-batches (recorded as fedllm's collate made them) are
trained again by bare loops on the same model:

- ``bare``: ``zero_grad``, the batch moved to the device, the loss, ``backward``, ``torch.optim.AdamW`` with
  the recipe's arguments and torch's defaults for the rest (as a PEFT user writes it), one optimizer per client;
- ``bare-plain``: the same with ``model(**batch).loss`` (logits at every position) instead of fedllm's
  supervised-positions loss (:func:`fedllm.models.supervised_loss.supervised_positions_loss`), whose LM head runs
  at the answer positions only.

``--compile MODE`` sets ``train.compile`` (``true``: inductor, ``cudagraphs``: inductor and CUDA graphs) for fedllm's
clients only: the bare loops stay eager, so the ratio then shows what compiling gains over a bare eager loop.

The bare loops start from the state fedllm's last client left and the model is restored after them, so fedllm's
run is untouched. Figures per micro-batch (wall and CPU seconds of this process; the device synchronised around
each timed region): ``fedllm round`` = :meth:`LocalExecutor.train` of the round (configure, load, train, read back
and check every sampled client) over its micro-batches; ``fedllm loop`` = the clients' own training loops
(:class:`~fedllm.models.flops.TrainedWork` seconds: from the first micro-batch to the last optimizer step);
``bare``, ``bare-plain``. Round 1 is warm-up and not counted; each figure is the median over the counted rounds
of all trials, and ``ratio`` divides it by ``bare``'s. ``--profile`` adds one more trial, not counted: torch.profiler's
top operators of its round 2 and the operators whose calls per micro-batch differ most between fedllm and ``bare``
there, then cProfile's top functions of fedllm's rounds 3.. (by own time; give ``--rounds 3`` or more).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

from bench.gpu_check import write_data
from fedllm.engine.server import LocalExecutor

MODES = ("fedllm round", "fedllm loop", "bare", "bare-plain")
COMPILE = {"false": False, "true": True, "cudagraphs": "cudagraphs"}  # --compile -> train.compile (the bare loops stay eager)


def build_model_dir(where: Path, layers: int, hidden: int, heads: int, vocab: int, shapes: str | None = None) -> Path:
    """A deep, narrow LLaMA (random weights, seed 0) and fedllm's small tokenizer, written to ``where``; ``shapes``:
    instead the config fedllm ships for that preset (``fedllm/assets/configs/<shapes>``, e.g. SmolLM2's)."""
    import transformers

    from fedllm.models.info import CONFIGS_DIR
    from fedllm.models.loading import tiny_tokenizer

    if shapes:
        config = transformers.AutoConfig.from_pretrained(str(CONFIGS_DIR / shapes))
    else:
        config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                                          num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                                          max_position_embeddings=1024, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(where))
    tiny_tokenizer().save_pretrained(str(where))
    return where


def recipe_for(model_dir: Path, data: Path, out: Path, args: argparse.Namespace) -> Any:
    from fedllm.recipe.checks import parse_recipe

    return parse_recipe({
        "seed": 0, "output_dir": str(out),
        "model": {"name": str(model_dir), "dtype": args.dtype, "device_map": args.device if args.device != "cpu"
                  else None},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(data), "format": "instruction", "cache": False,
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": args.rounds, "partition": {"method": "iid"}},
        "train": {"local_steps": args.steps, "batch_size": args.batch, "max_length": args.max_length, "lr": 1e-3,
                  "dtype": args.dtype, "threads": args.threads,
                  **({"compile": COMPILE[args.compile]} if getattr(args, "compile", None) else {})},
        "logging": {"progress": False, "quiet": True}}, source="<step_overhead>")


class Timer:
    """Wall and CPU seconds of a region, the device synchronised at both ends."""

    def __init__(self, synchronize: Callable[[], None]):
        self.synchronize = synchronize

    def __enter__(self) -> Self:
        self.synchronize()
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.synchronize()
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def bare_loop(model: torch.nn.Module, clients: list[list[dict]], cfg: Any, loss_of: Callable) -> None:
    """Each client's micro-batches through a bare PEFT loop (one AdamW per client, as fedllm makes one)."""
    params = [p for p in model.parameters() if p.requires_grad]
    device = params[0].device
    for batches in clients:
        opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        for batch in batches:
            opt.zero_grad(set_to_none=True)
            batch = {k: v.to(device) for k, v in batch.items()}
            with autocast(device, cfg.dtype):
                loss = loss_of(model, batch)
            loss.backward()
            opt.step()


def autocast(device: torch.device, dtype: str):
    from fedllm.engine.client import train_autocast

    return train_autocast(device, dtype)


def supervised_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from fedllm.models.supervised_loss import supervised_positions_loss

    return supervised_positions_loss(model, batch)


def plain_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


class ComparingExecutor(LocalExecutor):
    """fedllm's executor; each round it times itself, then the bare loops on the round's own micro-batches."""

    def __init__(self, synchronize: Callable[[], None], profile: bool):
        super().__init__()
        self.synchronize = synchronize
        self.rows: list[dict[str, Any]] = []
        self.clients: list[list[dict]] = []
        self.loop_seconds: list[tuple[float, float]] = []
        self.cprofile = cProfile.Profile() if profile else None
        self.torch_profiles: dict[str, Any] = {}  # "fedllm", "bare" -> torch.profiler key averages of round 2
        self.profiled_micro_batches = 1

    def recording(self, collate: Callable[[list[dict]], dict]) -> Callable[[list[dict]], dict]:
        def collate_and_record(items: list[dict]) -> dict:
            batch = collate(items)
            self.clients[-1].append({k: v.clone() for k, v in batch.items()})
            return batch

        collate_and_record.recording = True  # type: ignore[attr-defined]
        return collate_and_record

    def train_one(self, loop: Any, rnd: int, plan: Any, expected: Any, kept: Any, bar: Any) -> Any:
        self.clients.append([])
        update = super().train_one(loop, rnd, plan, expected, kept, bar)
        self.loop_seconds.append((update.work["seconds"], update.work["cpu_seconds"]))
        return update

    def train(self, loop: Any, rnd: int, sampled: list[int], lr: float, bar: Any):
        if not getattr(loop.collate, "recording", False):
            loop.collate = self.recording(loop.collate)
        self.clients, self.loop_seconds = [], []
        profiling = self.cprofile is not None and rnd > 1
        torch_round = profiling and not self.torch_profiles  # round 2: torch.profiler; later rounds: cProfile
        with Timer(self.synchronize) as fed, self.profiled("fedllm", torch_round, profiling):
            out = super().train(loop, rnd, sampled, lr, bar)
        micro = sum(len(c) for c in self.clients)
        row = {"round": rnd, "micro_batches": micro,
               "fedllm round": (fed.wall / micro, fed.cpu / micro),
               "fedllm loop": (sum(w for w, _ in self.loop_seconds) / micro,
                               sum(c for _, c in self.loop_seconds) / micro)}
        self.rows.append(row)
        self.time_bare(loop, row, micro, torch_round)
        return out

    @contextlib.contextmanager
    def profiled(self, name: str, torch_round: bool, cprofile: bool):
        """torch.profiler (its key averages kept per micro-batch under ``name``) or cProfile around a region."""
        if torch_round:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            with profile(activities=activities) as prof:
                yield
            self.torch_profiles[name] = prof.key_averages()
        elif cprofile:
            self.cprofile.enable()
            yield
            self.cprofile.disable()
        else:
            yield

    def time_bare(self, loop: Any, row: dict[str, Any], micro: int, torch_round: bool) -> None:
        """The bare loops on this round's micro-batches, from the model as fedllm left it (restored after)."""
        model, cfg = loop.model, loop.recipe.train
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        saved = {n: p.detach().clone() for n, p in trained.items()}
        was_training = model.training  # a run's model is in eval mode between clients: left so
        model.train()
        for mode, loss_of in (("bare", supervised_loss), ("bare-plain", plain_loss)):
            with Timer(self.synchronize) as t, self.profiled(mode, torch_round and mode == "bare", False):
                bare_loop(model, self.clients, cfg, loss_of)
            row[mode] = (t.wall / micro, t.cpu / micro)
            with torch.no_grad():
                for n, p in trained.items():
                    p.copy_(saved[n])
                    p.grad = None
        model.train(was_training)
        if torch_round:
            row["profiled"] = True  # not counted: the profiler slows what it watches
            self.profiled_micro_batches = micro


def one_trial(args: argparse.Namespace, model_dir: Path, data: Path, work: Path, trial: int) -> ComparingExecutor:
    from fedllm.engine.server import run

    recipe = recipe_for(model_dir, data, work / f"run{trial}", args)
    cuda = args.device.startswith("cuda")
    executor = ComparingExecutor(torch.cuda.synchronize if cuda else (lambda: None), profile=trial < 0)
    executor.result = run(recipe, progress=False, executor=executor)
    return executor


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median per-micro-batch wall and CPU seconds of each mode over the counted rounds (round 1 is warm-up)."""
    counted = [r for r in rows if r["round"] > 1 and not r.get("profiled")]
    out = {}
    for mode in MODES:
        out[mode] = {"s": statistics.median(r[mode][0] for r in counted),
                     "cpu_s": statistics.median(r[mode][1] for r in counted)}
    return out


def print_torch_profiles(executor: ComparingExecutor) -> None:
    """fedllm's top operators in round 2 (self CPU time), then the operators whose calls per micro-batch differ
    most between fedllm's round and the bare loop on the same micro-batches."""
    fed, bare = executor.torch_profiles["fedllm"], executor.torch_profiles["bare"]
    print("torch.profiler, fedllm's round 2 of the profiled trial (by self CPU time):\n"
          + fed.table(sort_by="self_cpu_time_total", row_limit=30))
    micro = executor.profiled_micro_batches
    calls = [{e.key: (e.count / micro, e.self_cpu_time_total / micro) for e in events} for events in (fed, bare)]
    keys = sorted(set(calls[0]) | set(calls[1]), key=lambda k: -abs(calls[0].get(k, (0, 0))[1]
                                                                      - calls[1].get(k, (0, 0))[1]))
    print(f"per micro-batch: {'operator':<58} {'fedllm calls':>12} {'bare calls':>10} {'fedllm self us':>14} "
          f"{'bare self us':>12}")
    print(f"{'':<17}{'(all operators)':<58} {sum(c for c, _ in calls[0].values()):>12.0f} "
          f"{sum(c for c, _ in calls[1].values()):>10.0f} {sum(t for _, t in calls[0].values()):>14.0f} "
          f"{sum(t for _, t in calls[1].values()):>12.0f}")
    for k in keys[:25]:
        (fc, ft), (bc, bt) = calls[0].get(k, (0, 0)), calls[1].get(k, (0, 0))
        print(f"{'':<17}{k[:58]:<58} {fc:>12.1f} {bc:>10.1f} {ft:>14.0f} {bt:>12.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds per trial (round 1 is warm-up)")
    p.add_argument("--steps", type=int, default=4, help="local steps per client")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--shapes", default=None, help="a preset whose shipped config to build instead (random weights): "
                   "smollm2-135m-instruct, gemma3-270m")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", default=None, choices=tuple(COMPILE), help="train.compile for fedllm's clients "
                   "(the bare loops stay eager); default: the recipe's default")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU-seconds free of OpenMP's waits)")
    p.add_argument("--profile", action="store_true", help="one more trial (not counted), profiled")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error("--rounds must be at least 2 (round 1 is warm-up)")
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="step_overhead-"))
    model_dir = build_model_dir(work / "model", args.layers, args.hidden, args.heads, args.vocab, args.shapes)
    data = write_data(work / "train.jsonl", 64)
    rows: list[dict[str, Any]] = []
    for trial in range(args.trials):
        executor = one_trial(args, model_dir, data, work, trial)
        for r in executor.rows:
            rows.append({"trial": trial, **r})
            if r["round"] > 1:
                print(f"trial {trial} round {r['round']}: " + "  ".join(
                    f"{m} {1e3 * r[m][0]:.1f} ms ({1e3 * r[m][1]:.1f} CPU-ms)" for m in MODES), flush=True)
    summary = summarise(rows)
    load = os.getloadavg()
    model = (args.shapes or f"{args.layers} layers x hidden {args.hidden}") + (
        f", fedllm with train.compile {args.compile}" if args.compile else "")
    print(f"\n{model}, micro-batch {args.batch} x {args.max_length}, {args.dtype}, "
          f"{args.device}, {args.threads} thread(s); load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'per micro-batch':<14} {'ms':>8} {'CPU-ms':>8} {'ratio':>7} {'ratio CPU':>9}")
    base = summary["bare"]
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:<14} {1e3 * s['s']:>8.1f} {1e3 * s['cpu_s']:>8.1f} {s['s'] / base['s']:>7.2f} "
              f"{s['cpu_s'] / base['cpu_s']:>9.2f}")
    if args.profile:  # a trial of its own, not counted (the profilers slow what they watch)
        profiled = one_trial(args, model_dir, data, work, -1)
        text = io.StringIO()
        pstats.Stats(profiled.cprofile, stream=text).sort_stats("tottime").print_stats(35)
        print("\ncProfile of fedllm's rounds 3.. of the profiled trial (by own time):\n" + text.getvalue())
        print_torch_profiles(profiled)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary, "load": load,
                                               "args": vars(args), "date": time.strftime("%F %T %Z")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
