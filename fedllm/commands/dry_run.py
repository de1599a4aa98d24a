"""``fedllm train RECIPE --dry-run``: know the cost of a recipe before committing to it.

Validates the recipe, builds everything a run builds (tokenizer, data, partition,
model, strategy), times a few optimizer steps of one client through the real client
loop, and estimates the seconds per round and for the run; then prints the cost report
of :mod:`fedllm.commands.cost_report` (parameters per module type, LoRA targets, bytes per client
and per round, state bytes, a peak-memory estimate, FRLoRA's SVD-init cost).

Without the model's weights on this machine (a hub id offline, a preset's package not
installed) the model is built on the meta device from fedllm's shipped config
(:mod:`fedllm.models.info`) and the same cost report is printed, without timing;
without the data set the figures that need it use the recipe's batch size and
``max_length``, and the report says what it could not check. Nothing is written to
``output_dir``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional

from fedllm.commands.memory_fit import fits_lines
from fedllm.recipe.schema import Recipe
from fedllm.runs.comm_budget import projection_lines

#: Optimizer steps timed (the first is a warm-up and not counted).
TIMED_STEPS = 3


class _Enough(Exception):
    """Raised by the step timer to stop the client loop after the timed steps."""


class _StepTimer:
    """Stands in for the progress bar of ``train_client``: records when each step ends, stops after ``limit``."""

    def __init__(self, limit: int):
        self.ends = [time.perf_counter()]
        self.cpu_ends = [time.process_time()]
        self.limit = limit

    def update(self, n: int = 1) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        if len(self.ends) > self.limit:
            raise _Enough

    def seconds_per_step(self) -> float:
        gaps = [b - a for a, b in zip(self.ends[:-1], self.ends[1:])]
        timed = gaps[1:] or gaps
        return sum(timed) / len(timed)


@dataclass
class DryRunReport:
    """What ``--dry-run`` measured and estimated."""

    recipe: Recipe
    build_seconds: float
    seconds_per_step: float
    steps_per_round: int
    bytes_up: int
    bytes_down: int
    eval_rounds: list[int]
    costs: Any = None  # fedllm.commands.cost_report.CostReport
    eval_seconds: float = 0.0  # one evaluation of every timed task
    eval_untimed: tuple[str, ...] = ()  # "task (why)" of the tasks not timed
    throughput: str = ""  # tokens/s, FLOPs per step, FLOP/s and MFU of the timed steps (fedllm.engine.throughput)

    @property
    def seconds_per_round(self) -> float:
        return self.seconds_per_step * self.steps_per_round

    @property
    def seconds_total(self) -> float:
        """Building the federation, every round and every evaluation."""
        return (self.build_seconds + self.seconds_per_round * self.recipe.federation.rounds
                + self.eval_seconds * len(self.eval_rounds))

    def report(self) -> str:
        r = self.recipe
        evals = []
        if r.eval.tasks and self.eval_rounds:
            untimed = f"; not timed: {', '.join(self.eval_untimed)}" if self.eval_untimed else ""
            evals = [f"  evaluation ({', '.join(r.eval.tasks)}) after round(s) {', '.join(map(str, self.eval_rounds))}:"
                     f" up to ~{_duration(self.eval_seconds)} each (one batch of each task timed on the starting "
                     f"model; a trained model's answers stop sooner){untimed}"]
        return "\n".join([
            f"dry run of {r.source}: recipe valid; data, model ({r.model.name}) and strategy "
            f"({r.federation.strategy}) built in {self.build_seconds:.1f} s",
            f"  one optimizer step: {self.seconds_per_step:.3f} s (mean of {TIMED_STEPS - 1} after a warm-up; "
            f"batch {r.train.batch_size} x grad_accum {r.train.grad_accum}, max_length {r.train.max_length}"
            f"{packing_note(r)})",
            *([f"  throughput of those steps: {self.throughput}"] if self.throughput else []),
            f"  per round: {self.steps_per_round} client steps ({r.sampled_per_round()} clients) -> "
            f"~{_duration(self.seconds_per_round)}",
            *evals,
            f"  whole run: building, {r.federation.rounds} rounds and the evaluations -> "
            f"up to ~{_duration(self.seconds_total)} at this machine's load now ({_load()})",
            f"  bytes per round: up {self.bytes_up / 1024**2:.2f} MB, down {self.bytes_down / 1024**2:.2f} MB "
            f"({r.federation.comm_dtype})",
            *projection_lines(self.bytes_up, self.bytes_down, r.federation.rounds,
                              r.federation.communication_budget_mb),
            *(self.costs.lines() + fits_lines(self.costs) if self.costs is not None else []),
            *deadline_lines(r),
            *async_lines(r),
            f"  nothing was written to {r.output_dir}",
        ])


@dataclass
class UntimedReport:
    """``--dry-run`` without the weights or without the data: the cost report, no step timing."""

    recipe: Recipe
    build_seconds: float
    costs: Any  # fedllm.commands.cost_report.CostReport
    built: str  # how the model was built
    flops: str = ""  # FLOPs per step at full length (fedllm.models.flops), and the device's peak

    def report(self) -> str:
        r = self.recipe
        return "\n".join([
            f"dry run of {r.source}: recipe valid; model ({r.model.name}) {self.built} and strategy "
            f"({r.federation.strategy}) set up in {self.build_seconds:.1f} s; no step timed",
            *([f"  {self.flops}"] if self.flops else []),
            *self.costs.lines(),
            *fits_lines(self.costs),
            *projection_lines(self.costs.comm.round_up, self.costs.comm.round_down, r.federation.rounds,
                              r.federation.communication_budget_mb),
            *deadline_lines(r),
            *async_lines(r),
            f"  nothing was written to {r.output_dir}",
        ])


def deadline_lines(r: Recipe) -> list[str]:
    """``federation.round_deadline``: how long a round waits and what a late client means for the strategy."""
    if r.federation.round_deadline is None:
        return []
    from fedllm.common.registry import strategies
    from fedllm.engine.round_deadline import RoundDeadline

    deadline = RoundDeadline.of(r.federation.round_deadline, r.federation.min_clients_per_round)
    secure = ("; under SecAgg+ a late client is a dropout (a round completes with at most "
              f"privacy.secagg.max_dropouts = {r.privacy.secagg.max_dropouts} of them)") \
        if r.privacy.secure_aggregation == "secagg_plus" else ""
    return [f"  round deadline: {deadline.describe()}; a late client is "
            f"{strategies.get(r.federation.strategy).late_update}{secure}"]


def async_lines(r: Recipe) -> list[str]:
    """``federation.mode: async``: the buffer, the concurrency, the staleness weight and what a round is."""
    if r.federation.mode != "async":
        return []
    from fedllm.engine.fedbuff import FedBuff

    return [f"  {FedBuff(r).describe()}; federation.rounds = {r.federation.rounds} server steps"]


def packing_note(r: Recipe) -> str:
    """``train.packing`` in the step line: what a timed step trains on."""
    return ("; packed: each micro-batch's examples end to end in one row, no padding (train.packing)"
            if r.train.packing else "")


def _load() -> str:
    """The 1-minute load average against the CPUs: the timings scale with what else runs."""
    import os

    try:
        return f"load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    except OSError:
        return f"{os.cpu_count()} CPUs"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.1f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def dry_run(recipe: Recipe) -> "DryRunReport | UntimedReport":
    """Build the federation and time :data:`TIMED_STEPS` local steps of the largest sampled client; without
    the weights or the data, the untimed cost report of the model (on the meta device without weights)."""
    from fedllm.data.errors import DataError
    from fedllm.engine.server import build_federation
    from fedllm.models.hardware import resolve_auto_dtypes
    from fedllm.models.info import weights_unavailable

    resolve_auto_dtypes(recipe)  # as a run resolves them (train.dtype / model.dtype: auto)
    missing = weights_unavailable(recipe.model)
    if missing is not None:
        return untimed(recipe, weights_missing=missing)
    t0 = time.perf_counter()
    try:
        fed = build_federation(recipe)
    except DataError as e:
        return untimed(recipe, data_missing=str(e).splitlines()[0])
    return _timed(recipe, fed, time.perf_counter() - t0)


def _estimated_clients(recipe: Recipe) -> tuple[list[int], Optional[int], list[str]]:
    """Client sizes and steps per round without the data: from ``data.max_examples`` or one round's batches."""
    fed, train = recipe.federation, recipe.train
    per_step = train.batch_size * train.grad_accum
    if recipe.data.max_examples:
        size, how = recipe.data.max_examples // fed.num_clients, f"data.max_examples / {fed.num_clients} clients"
    else:
        size, how = per_step * (train.local_steps or 1), "one round of batches"
    notes = [f"client sizes (taken as {size:,} examples each: {how}) and the partition"]
    steps = train.local_steps
    if steps is None:
        steps = max(1, math.ceil(train.local_epochs * size / per_step))
        notes.append(f"steps per round with local_epochs (taken as {steps} from that size)")
    notes.append(f"token lengths: activations taken at batch {train.batch_size} x max_length {train.max_length}")
    return [size] * fed.num_clients, steps, notes


def untimed(recipe: Recipe, weights_missing: Optional[str] = None,
            data_missing: Optional[str] = None) -> UntimedReport:
    """The cost report of the recipe's model without its data: built on the meta device from its config when
    ``weights_missing`` says why the weights are absent (tests pass any reason to force the meta device)."""
    import torch

    from fedllm.commands.cost_report import cost_report
    from fedllm.models.info import shipped_config_dir
    from fedllm.models.loading import load_model
    from fedllm.models.meta import check_targets, meta_model
    from fedllm.recipe.schedule import derived_seed
    from fedllm.strategies import get_strategy
    from fedllm.strategies.base import ClientInfo

    from fedllm.models.hardware import resolve_auto_dtypes

    resolve_auto_dtypes(recipe)
    t0 = time.perf_counter()
    sizes, steps, notes = _estimated_clients(recipe)
    num_labels = len(recipe.data.labels) if recipe.data.labels else 2
    if weights_missing is not None:
        model, task = meta_model(recipe.model, recipe.lora, num_labels, recipe.source)
        where = shipped_config_dir(recipe.model.name)
        built = "built on the meta device from " + (f"fedllm's shipped config ({where.relative_to(where.parents[3])})"
                                                    if where else "its config")
        source = f"{recipe.model.name} on the meta device (weights absent: {weights_missing})"
        notes = ["step time (no weights here)", f"the data set {recipe.data.path} (not loaded without the model's tokenizer)"] + notes
    else:
        loaded = load_model(recipe.model, recipe.lora, num_labels, recipe.seed, recipe.source)
        model, task, built = loaded.model, loaded.task, "loaded"
        check_targets(model, recipe.lora, recipe.model.name, recipe.source)
        source = f"{recipe.model.name} (real weights)"
        notes = [f"step time and the data set ({data_missing})"] + notes
    if task == "classification" and not recipe.data.labels and not recipe.model.num_labels:
        notes.append("classifier labels (taken as 2: set data.labels or model.num_labels)")
    strategy = get_strategy(recipe.federation.strategy, **recipe.federation.strategy_args)
    strategy.recipe = recipe
    torch.manual_seed(derived_seed(recipe.seed, 0x57A7))
    strategy.setup(model, [ClientInfo(c, n) for c, n in enumerate(sizes)])
    costs = cost_report(recipe, model, strategy, task, source, weights_missing is not None, steps, notes,
                        tokenizer=None if weights_missing is not None else loaded.tokenizer)
    return UntimedReport(recipe, time.perf_counter() - t0, costs, built,
                         full_length_flops(recipe, model, task, strategy, on_meta=weights_missing is not None))


def full_length_flops(recipe: Recipe, model: Any, task: str, strategy: Any, on_meta: bool) -> str:
    """FLOPs of one optimizer step with every row at ``max_length`` and the head at every position (an upper
    bound, :mod:`fedllm.models.flops`), and the peak of this machine's device (a CPU probe unless on the meta
    device, where the weights' device is unknown)."""
    from fedllm.engine.throughput import Throughput
    from fedllm.models.flops import TrainedWork

    t = Throughput(recipe, model, task, _dense_residual(strategy), measure_peak=not on_meta)
    if t.shapes is None:
        return ""
    rows, length = recipe.train.batch_size * recipe.train.grad_accum, recipe.train.max_length
    step = TrainedWork(positions=rows * length, square=rows * length * length, head=rows * length).flops(t.shapes,
                                                                                                      t.residual)
    peak = (f"; {t.peak.dtype} peak of this machine {t.peak.flops_per_s / 1e9:,.1f} GFLOP/s ({t.peak.source})"
            if t.peak else "")
    return (f"FLOPs per optimizer step: {step / 1e9:,.3f} GFLOP at most ({rows} rows x max_length {length}, "
            f"the LM head at every position){peak}")


def _dense_residual(strategy: Any) -> bool:
    return getattr(getattr(strategy, "base", None), "mode", None) == "dense"  # FRLoRA's hooked residual


def _timed(recipe: Recipe, fed: Any, build_seconds: float) -> DryRunReport:
    """Time :data:`TIMED_STEPS` local steps of the largest sampled client and add the cost report."""
    from functools import partial

    from fedllm.commands.cost_report import client_bytes, cost_report
    from fedllm.data.collate import collate
    from fedllm.engine.client import head_at_every_position, micro_batch, packed_row_length, resolved, run_client
    from fedllm.engine.server import sample_clients
    from fedllm.engine.throughput import Throughput, describe
    from fedllm.models.flops import TrainedWork
    from fedllm.evaluation.runner import eval_due
    from fedllm.models.loading import read_state
    from fedllm.models.meta import check_targets
    from fedllm.models.state import cast
    from fedllm.recipe.schedule import derived_seed, steps_per_round
    from fedllm.runs.client_store import ClientStore

    strategy, data, comm = fed.strategy, fed.data, recipe.federation.comm_dtype
    global_state = read_state(fed.loaded.model, fed.global_keys)
    sampled = sample_clients(recipe.seed, 1, recipe.federation.num_clients, recipe.sampled_per_round())
    largest = sorted(range(recipe.federation.num_clients), key=lambda c: -len(data.clients[c]))
    steps, up, down = 0, 0, 0
    for cid in largest[:recipe.sampled_per_round()]:
        plan = strategy.configure_client(1, cid, global_state)
        plan.state = cast(plan.state, comm)
        default = steps_per_round(recipe.train, len(data.clients[cid]))
        steps += sum(ph.steps if ph.steps is not None else default for ph in plan.phases)
        client_down, client_up = client_bytes(recipe, strategy, plan, global_state, default)
        down, up = down + client_down, up + client_up
    down += sum(strategy.extra_download_bytes(1, sampled, recipe.federation.num_clients, comm).values())

    check_targets(fed.loaded.model, recipe.lora, recipe.model.name, recipe.source)
    costs = cost_report(recipe, fed.loaded.model, strategy, fed.loaded.task, f"{recipe.model.name} (real weights)",
                        False, steps_per_round(recipe.train, len(data.clients[largest[0]])),
                        tokenizer=fed.loaded.tokenizer)
    cid = largest[0]
    plan = strategy.configure_client(1, cid, global_state)
    plan.lr = recipe.train.lr
    timer = _StepTimer(TIMED_STEPS)
    plain = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
    counted: list[TrainedWork] = []  # one per micro-batch, in order
    head_everywhere = head_at_every_position(fed.loaded.model, recipe.train)
    row_length = packed_row_length(fed.loaded.model, recipe.train)
    as_trained = resolved(recipe.train, next(fed.loaded.model.parameters()).device)

    def coll(items: list[dict]) -> dict:
        batch = plain(items)
        counted.append(TrainedWork())
        trained, tokens = micro_batch(lambda _: batch, items, as_trained, row_length)  # as the client trains it
        counted[-1].add_batch(trained, head_everywhere, tokens)
        return batch

    try:
        run_client(fed.loaded.model, plan, strategy, ClientStore(), data.examples, data.clients[cid], recipe.train,
                   coll, derived_seed(recipe.seed, 1, cid), timer)
    except _Enough:
        pass
    throughput = Throughput(recipe, fed.loaded.model, fed.loaded.task, _dense_residual(strategy))
    timed = TrainedWork()
    for w in counted[recipe.train.grad_accum:]:  # after the warm-up step
        timed = timed.merge(w)
    timed.seconds = timer.ends[-1] - timer.ends[min(1, len(timer.ends) - 1)]
    timed.cpu_seconds = timer.cpu_ends[-1] - timer.cpu_ends[min(1, len(timer.cpu_ends) - 1)]
    figures = throughput.figures(timed, max(1, len(timer.ends) - 2))
    eval_rounds: list[Any] = [r for r in range(recipe.federation.rounds + 1) if eval_due(recipe.eval, r,
                                                                                        recipe.federation.rounds)]
    eval_seconds, eval_untimed = _eval_seconds(recipe, fed) if eval_rounds else (0.0, [])
    return DryRunReport(recipe, build_seconds, timer.seconds_per_step(), steps, up, down, eval_rounds, costs,
                        eval_seconds=eval_seconds, eval_untimed=tuple(eval_untimed),
                        throughput=describe(figures, throughput.peak))


def _eval_seconds(recipe: Recipe, fed: Any) -> tuple[float, list[str]]:
    """Seconds of one evaluation of the recipe's tasks: each task timed on one batch (``eval.batch_size``
    examples) and scaled to the examples it evaluates; ``"task (why)"`` for each task it cannot time: a judged
    or lm-evaluation-harness task (a dry run calls no judge and runs no harness), or one whose data are not here
    (nothing is downloaded)."""
    import dataclasses

    from fedllm.common.errors import InputError
    from fedllm.evaluation import evaluate, prompt_style_for_data
    from fedllm.evaluation.judged_task import JudgedTask
    from fedllm.evaluation.runner import eval_config_for_data, make_task

    data, cfg = fed.data, eval_config_for_data(recipe.eval, recipe.data)
    dpo = recipe.train.preference if recipe.train.objective == "dpo" else None
    seconds, untimed = 0.0, []
    for name in recipe.eval.tasks:
        task = make_task(name)
        if isinstance(task, JudgedTask) or name.startswith("lm_eval:") or (cfg.answer_protocol == "lm_eval" and \
                getattr(task, "lm_eval_task", "")):
            untimed.append(f"{name} (judged or run by lm-evaluation-harness)")
            continue
        if name in ("held_out", "pref_accuracy"):
            size = len(data.eval_examples)
        elif task.uses_records and data.eval_records and name not in cfg.data:
            size = len(data.eval_records)
        else:
            size = cfg.limit
        size = min(size, cfg.limit) if size is not None and cfg.limit is not None else size
        if not size:
            untimed.append(f"{name} (its number of examples is known only when it reads its data; set eval.limit)")
            continue
        batch = min(size, cfg.batch_size)
        start = time.perf_counter()
        try:
            evaluate(fed.loaded.model, fed.loaded.tokenizer, dataclasses.replace(cfg, tasks=[name], limit=batch),
                     None, records=data.eval_records, eval_examples=data.eval_examples,
                     prompt_style=prompt_style_for_data(recipe.data, recipe.eval), progress=False, preference=dpo)
        except (InputError, OSError) as e:  # its data are not here: the real run would read or download them
            untimed.append(f"{name} ({str(e).splitlines()[0][:120]})")
            continue
        seconds += (time.perf_counter() - start) * math.ceil(size / batch)
    return seconds, untimed
