"""Round throughput: fedllm vs a trl SFTTrainer-per-client round and a plain PEFT + AdamW loop.

    python bench/throughput.py [--model smollm2-135m-instruct] [--rounds 3] [--steps 5] [--trials 2]

One FedAvg federation (10 clients, 2 per round, LoRA r=8 on q/v, batch 4, fp32) on arithmetic
problems behind a variable number of solved few-shot examples (response-only loss: most positions
carry label -100; prompts of very different lengths). Every fedllm configuration and both peers
train the same clients on the same micro-batches (the peers are fed exactly the examples, in the
order, that fedllm's seeded stream draws), so their losses agree; group_by_length changes the
batches, so its losses differ. The configurations, run interleaved trial after trial:

- ``sft-per-client``: what OpenFedLLM does: per client per round, the global LoRA state is
  deep-copied into the model, a fresh ``trl.SFTTrainer`` is built over the client's examples
  (sequential sampler, constant lr, AdamW, no clipping) and trained, and its state deep-copied out;
- ``plain-peft``: a bare PEFT + AdamW loop over the same clients and batches (``model(**batch).loss``);
- fedllm with nothing on (``fedllm plain``: ``loss_positions: all``), with each of items 1-3 on alone, and all together
  (``clients_per_pass`` = clients per round).

Prints seconds per round (median of rounds 2.. of each trial, best trial) with ratios and the final
round's train loss, then start-up seconds of a first run (empty tokenized-data cache) vs a second.
Use ``--dtype bf16`` for bf16 autocast.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import random
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from fedllm.data.collate import collate
from fedllm.data.synthetic import generate_arith
from fedllm.engine.client import BatchStream
from fedllm.engine.server import RoundLoop, build_federation, round_lr, sample_clients
from fedllm.models.loading import read_state, write_state
from fedllm.models.state import weighted_mean
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schedule import derived_seed, steps_per_round

ITEMS = {  # name -> train overrides (on top of the plain configuration)
    "fedllm plain": {},
    "1 loss-only logits": {"loss_positions": "supervised"},
    "2 group_by_length": {"group_by_length": True},
    "3 clients_per_pass=K": {"clients_per_pass": "K"},
    "all (1+2+3)": {"loss_positions": "supervised", "group_by_length": True, "clients_per_pass": "K"},
    "all + bf16 autocast": {"loss_positions": "supervised", "group_by_length": True, "clients_per_pass": "K",
                            "dtype": "bf16"},
}


def few_shot_records(n: int, max_shots: int, seed: int = 0) -> list[dict]:
    """Arithmetic problems behind 0..max_shots solved examples (~45 tokens each), short answers."""
    rng = random.Random(seed)
    pool = generate_arith(4 * n, seed=seed)
    out = []
    for rec in pool[:n]:
        shots = rng.sample(pool[n:], rng.randint(0, max_shots))
        context = "".join(f"Q: {s['question']}\nA: {s['answer']}\n\n" for s in shots)
        out.append({"question": context + "Q: " + rec["question"], "answer": rec["answer"],
                    "category": rec["category"]})
    return out


def make_recipe(args, data: Path, out: Path, cache: bool = True, **train):
    return parse_recipe({
        "seed": 0, "output_dir": str(out), "model": {"name": args.model},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"]},
        "data": {"path": str(data), "format": "instruction", "cache": cache,
                 "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": 10, "clients_per_round": args.per_round, "rounds": args.rounds,
                       "partition": {"method": "iid"}},
        "train": {"local_steps": args.steps, "batch_size": 4, "lr": 1e-4, "max_length": args.max_length,
                  "dtype": args.dtype, **train},
        "checkpoint": {"every": 0}, "logging": {"progress": False, "quiet": True}})


def client_batches(recipe, fed, rnd: int, cid: int) -> list[list[int]]:
    """The micro-batches fedllm's seeded stream gives client ``cid`` in round ``rnd`` (without grouping)."""
    tr = recipe.train
    stream = BatchStream(fed.data.clients[cid], tr.batch_size, derived_seed(recipe.seed, rnd, cid))
    return [stream.next() for _ in range(steps_per_round(tr, len(fed.data.clients[cid])))]


class TimedLoop(RoundLoop):
    """The round loop, also recording the CPU seconds of each round (``cpu_seconds``)."""

    def run_round(self, rnd, bar):
        c0 = time.process_time()
        record = super().run_round(rnd, bar)
        record["cpu_seconds"] = time.process_time() - c0
        return record


def fedllm_rounds(fed, recipe, initial, out: Path) -> tuple[list[tuple[float, float]], float]:
    """Run the federation with ``recipe``'s train options: (wall, CPU) seconds per round, last round's loss."""
    write_state(fed.loaded.model, initial)
    fed.recipe = recipe
    out.mkdir(parents=True)
    history = TimedLoop(fed, out, progress=False).run().history
    rounds = [h for h in history if h.get("round", 0) > 0]
    return [(h["seconds"], h["cpu_seconds"]) for h in rounds], rounds[-1]["train_loss"]


def peer_rounds(model, fed, recipe, initial, train_client) -> tuple[list[tuple[float, float]], float]:
    """Rounds of FedAvg where ``train_client(rnd, cid, batches, lr) -> mean loss`` trains ``model`` in place."""
    keys = list(initial)
    global_state = {k: v.clone() for k, v in initial.items()}
    times, loss = [], 0.0
    for rnd in range(1, recipe.federation.rounds + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        states, losses, sizes = [], [], []
        for cid in sample_clients(recipe.seed, rnd, 10, recipe.sampled_per_round()):
            write_state(model, copy.deepcopy(global_state))
            losses.append(train_client(rnd, cid, client_batches(recipe, fed, rnd, cid), round_lr(recipe, rnd)))
            states.append(copy.deepcopy(read_state(model, keys)))
            sizes.append(len(fed.data.clients[cid]))
        global_state = weighted_mean(states, [float(n) for n in sizes])
        times.append((time.perf_counter() - t0, time.process_time() - c0))
        loss = sum(l * n for l, n in zip(losses, sizes, strict=True)) / sum(sizes)
    return times, loss


def plain_peft_client(model, fed, recipe):
    """A bare PEFT + AdamW loop over the given batches (full logits, the model's own loss)."""
    coll = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id)

    def train(rnd, cid, batches, lr):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        model.train()
        losses = []
        for ids in batches:
            opt.zero_grad(set_to_none=True)
            loss = model(**coll([fed.data.examples[i] for i in ids])).loss
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        return sum(losses) / len(losses)

    return train


def sft_trainer_client(model, fed, recipe, out: Path):
    """OpenFedLLM's pattern: a fresh trl SFTTrainer per client per round over the client's examples."""
    import datasets
    from transformers import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()

    tok = fed.loaded.tokenizer

    def train(rnd, cid, batches, lr):
        rows = [fed.data.examples[i] for b in batches for i in b]
        ds = datasets.Dataset.from_list([{"input_ids": ex["input_ids"],
                                          "completion_mask": [int(l != -100) for l in ex["labels"]]}
                                         for ex in rows])
        cfg = SFTConfig(output_dir=str(out), per_device_train_batch_size=recipe.train.batch_size,
                        max_steps=len(batches), learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                        optim="adamw_torch", weight_decay=0.0, max_grad_norm=0.0, logging_steps=1,
                        report_to=[], save_strategy="no", train_sampling_strategy="sequential",
                        max_length=None, use_cpu=not torch.cuda.is_available(), bf16=recipe.train.dtype == "bf16",
                        disable_tqdm=True, seed=derived_seed(recipe.seed, rnd, cid) % (2**31),
                        dataloader_num_workers=0, completion_only_loss=True, remove_unused_columns=True,
                        gradient_checkpointing=False)
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok)
        trainer.remove_callback(PrinterCallback)
        trainer.train()
        logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return sum(logged) / len(logged)

    return train


def startup(args, data: Path, tmp: Path) -> list[dict]:
    """Start-up of a first run (empty cache) and a second one (cached), each in this process."""
    os.environ["FEDLLM_CACHE_DIR"] = str(tmp / "cache")
    out = []
    for attempt in ("first", "cached"):
        t0 = time.perf_counter()
        fed = build_federation(make_recipe(args, data, tmp / f"start-{attempt}"))
        out.append({"run": attempt, "seconds": time.perf_counter() - t0, **fed.timings,
                    "tokenized": fed.data.cache_info["tokenized"]})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=3, help="rounds per run (round 1 is a warm-up)")
    p.add_argument("--steps", type=int, default=5, help="local steps per client")
    p.add_argument("--per-round", type=int, default=2, help="clients per round (K of clients_per_pass)")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--records", type=int, default=400)
    p.add_argument("--max-shots", type=int, default=4, help="solved examples before a problem: 0..N (prompt length)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--trials", type=int, default=2, help="interleaved trials of every configuration")
    p.add_argument("--only", default="", help="comma-separated configuration names to run (default: all)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU seconds measure work, not spinning)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="fedllm-throughput-"))
    data = tmp / "fewshot.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in few_shot_records(args.records, args.max_shots)))

    starts = startup(args, data, tmp)
    base = make_recipe(args, data, tmp / "x", loss_positions="all")
    fed = build_federation(base)
    initial = read_state(fed.loaded.model, fed.global_keys)
    sft_model = copy.deepcopy(fed.loaded.model)  # trl may hook the model it trains: keep it off fedllm's
    sft_base = sft_model.get_base_model()
    if getattr(sft_base, "hf_quantizer", None) is not None and not any(
            p.dtype in (torch.int8, torch.uint8) for p in sft_base.parameters()):
        # GGUF weights are dequantized to fp32 on load, yet transformers flags the model as quantized
        # and Trainer refuses it; this copy is a plain fp32 model
        sft_base.hf_quantizer, sft_base.is_quantized = None, False
    k = args.per_round
    configs = {"sft-per-client": None, "plain-peft": None,
               **{name: {key: (k if v == "K" else v) for key, v in over.items()} for name, over in ITEMS.items()}}
    if args.only:
        configs = {n: c for n, c in configs.items() if n in args.only.split(",")}
    times: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in configs}
    losses: dict[str, float] = {}
    for trial in range(args.trials):  # interleaved: every configuration once per trial
        for name, over in configs.items():
            if name == "sft-per-client":
                t, loss = peer_rounds(sft_model, fed, base, initial,
                                      sft_trainer_client(sft_model, fed, base, tmp / f"sft{trial}"))
            elif name == "plain-peft":
                t, loss = peer_rounds(fed.loaded.model, fed, base, initial, plain_peft_client(fed.loaded.model, fed, base))
            else:
                recipe = dataclasses.replace(base, train=dataclasses.replace(base.train, **over))
                t, loss = fedllm_rounds(fed, recipe, initial, tmp / f"run-{trial}-{len(times[name])}-{abs(hash(name))}")
            times[name].append(t)
            losses[name] = loss
            print(f"trial {trial} {name}: wall/CPU s per round {', '.join(f'{w:.2f}/{c:.2f}' for w, c in t)}  "
                  f"loss {loss:.5f}", flush=True)

    def steady(t: list[tuple[float, float]], i: int) -> float:  # median over rounds 2.. of one trial
        return statistics.median(x[i] for x in (t[1:] or t))

    cpu = {n: min(steady(t, 1) for t in ts) for n, ts in times.items()}
    wall = {n: min(steady(t, 0) for t in ts) for n, ts in times.items()}
    ref, plain = cpu.get("sft-per-client"), cpu.get("plain-peft")
    print(f"\nmodel={args.model} dtype={args.dtype} 10 clients, {k}/round, LoRA r=8 q/v, {args.steps} steps x batch 4, "
          f"max_length {args.max_length}, 0-{args.max_shots} shots, {args.rounds} rounds (round 1 warm-up), "
          f"best of {args.trials} interleaved trials, {args.threads} torch thread(s)")
    print("| configuration | CPU s/round | speed-up vs SFTTrainer-per-client | vs plain PEFT | wall s/round (per trial) "
          "| final loss |")
    print("|---|---|---|---|---|---|")
    for name in configs:
        trials = ", ".join(f"{steady(t, 0):.2f}" for t in times[name])
        vs_ref = f"{ref / cpu[name]:.2f}x" if ref else "-"
        vs_plain = f"{plain / cpu[name]:.2f}x" if plain else "-"
        print(f"| {name} | {cpu[name]:.2f} | {vs_ref} | {vs_plain} | {trials} | {losses[name]:.5f} |")
    if ref:
        print("wall-clock speed-ups vs SFTTrainer-per-client: "
              + ", ".join(f"{n} {wall['sft-per-client'] / wall[n]:.2f}x" for n in configs))
    print("\n| start-up | seconds | tokenizer | data (load + tokenize) | model + strategy | records tokenized |")
    print("|---|---|---|---|---|---|")
    for s in starts:
        print(f"| {s['run']} run | {s['seconds']:.2f} | {s['tokenizer_seconds']:.2f} | {s['data_seconds']:.2f} | "
              f"{s['model_seconds']:.2f} | {s['tokenized']} |")


if __name__ == "__main__":
    main()
