"""THE round loop: sampling, dispatch, aggregation, evaluation, checkpoints, metrics.

``run(recipe)`` builds everything that can fail on bad input (tokenizer, data,
partition, model, strategy) *before* it writes anything, then trains round by
round. Every round appends one JSON line to ``metrics.jsonl``; checkpoints are
atomic, and ``resume=True`` continues bit-exactly from the newest one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import torch
from tqdm.auto import tqdm

from fedllm.common import threads
from fedllm.common.errors import InputError
from fedllm.common.redact import redact
from fedllm.common.tracking import Tracking
from fedllm.data import FederatedData, build_federated_data
from fedllm.data.collate import collate  # the function (the package attribute is the module once imported)
from fedllm.engine import client_faults
from fedllm.engine.batched_clients import client_passes, run_clients
from fedllm.engine.client import micro_batch_loss, run_client
from fedllm.engine.compiled import compile_choice
from fedllm.engine.compressed_rounds import Downlink
from fedllm.engine.distributed import Dispatch
from fedllm.engine.empty_clients import empty_clients, refuse_empty_clients
from fedllm.engine.fedbuff import FedBuff
from fedllm.engine.reference import (
    EVAL_REFERENCE_KEY,
    HELD_OUT,
    precompute_eval_references,
    precompute_references,
    with_reference,
)
from fedllm.engine.round_deadline import RoundDeadline, arrival_seconds
from fedllm.engine.secure_rounds import SecureRound, SummedUpdate
from fedllm.engine.throughput import Throughput, round_text
from fedllm.evaluation.personal import personal_stats
from fedllm.evaluation.runner import eval_due
from fedllm.models import gguf_cache
from fedllm.models.hardware import resolve_auto_dtypes
from fedllm.models.loading import (
    LoadedModel,
    load_model,
    load_tokenizer,
    lora_layers,
    read_state,
    resolve_task,
    write_state,
)
from fedllm.models.state import StateDict, cast, num_bytes
from fedllm.privacy import client_stats, with_privacy
from fedllm.privacy.secagg import SecAggError
from fedllm.privacy.secagg.settings import enabled as secure_aggregation
from fedllm.recipe.schedule import derived_seed, steps_per_round
from fedllm.recipe.schema import Recipe, dump_recipe
from fedllm.runs import checkpoint as ckpt_io
from fedllm.runs import comm_budget, rundir, runlock, strict_json
from fedllm.runs.client_store import ClientStore
from fedllm.runs.reference_cache import CACHE_NAME as REFERENCE_CACHE
from fedllm.runs.reference_cache import ReferenceCache, reference_fingerprint
from fedllm.runs.resume_check import check_resume_recipe
from fedllm.runs.rundir import RunDirError  # noqa: F401  (re-exported: raised by prepare_run_dir)
from fedllm.strategies import ClientInfo, ClientUpdate, Strategy, get_strategy

log = logging.getLogger("fedllm")


@dataclass
class RunResult:
    """What a run produced."""

    run_dir: Path
    history: list[dict[str, Any]]
    global_state: StateDict
    strategy: Strategy
    model: Any = None
    tokenizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    clients: Optional[ClientStore] = None  # every client's per-client state at the end


@dataclass
class Federation:
    """Everything a run needs in memory, built before anything is written."""

    recipe: Recipe
    loaded: LoadedModel
    data: FederatedData
    strategy: Strategy
    global_keys: list[str]
    timings: dict[str, float] = field(default_factory=dict)  # seconds of the start-up steps
    dtypes: dict[str, Any] = field(default_factory=dict)  # train.dtype / model.dtype as run, and why (auto)


def sample_clients(seed: int | bytes, rnd: int, num_clients: int, k: int, attempt: int = 0,
                   exclude: frozenset[int] = frozenset()) -> list[int]:
    """The ``k`` clients of round ``rnd`` (seeded by seed, round and retry ``attempt``; sorted).

    A retry (``attempt`` > 0) draws a fresh sample among the clients not in ``exclude`` (those
    dropped earlier in the round), as many as are left when fewer than ``k``. A ``bytes`` seed is a secret
    (client-level DP, :meth:`fedllm.privacy.central.ClientLevelDP.sampling_seed`): the sample is a ChaCha20 stream
    keyed by all of it (:func:`fedllm.privacy.secret_streams.subset`).
    """
    if isinstance(seed, bytes):
        from fedllm.privacy import secret_streams

        eligible = [c for c in range(num_clients) if not attempt or c not in exclude]
        key = secret_streams.stream_key(seed, "client-sample", rnd, attempt)
        return sorted(eligible[i] for i in secret_streams.subset(key, len(eligible), k))
    gen = torch.Generator().manual_seed(derived_seed(seed, rnd, 0x5A3, *([attempt] if attempt else [])))
    if not attempt:
        return sorted(torch.randperm(num_clients, generator=gen)[:k].tolist())
    eligible = [c for c in range(num_clients) if c not in exclude]
    return sorted(eligible[i] for i in torch.randperm(len(eligible), generator=gen)[:k].tolist())


LR_PROGRESS = {
    "first_to_last": lambda t, total: (t - 1) / (total - 1) if total > 1 else 0.0,
    "openfedllm": lambda t, total: (t - 1) / total,  # OpenFedLLM's cosine_learning_rate(round from 0, num_rounds)
    "flowertune": lambda t, total: t / total,  # FlowerTune's cosine_annealing(server_round from 1, num_rounds)
}
"""``train.lr_progress``: the position of round ``t`` of ``total`` (1-based) on the schedule, 0 (lr) to 1 (min_lr)."""


def round_lr(recipe: Recipe, rnd: int) -> float:
    """Learning rate of round ``rnd`` (1-based): constant, or cosine/linear decay across rounds."""
    tr, total = recipe.train, recipe.federation.rounds
    progress = LR_PROGRESS[tr.lr_progress](rnd, total)
    if tr.lr_schedule == "cosine":
        return tr.min_lr + 0.5 * (tr.lr - tr.min_lr) * (1 + math.cos(math.pi * progress))
    if tr.lr_schedule == "linear":
        return tr.lr + (tr.min_lr - tr.lr) * progress
    return tr.lr


def build_federation(recipe: Recipe) -> Federation:
    """Tokenizer, data + partition, model + LoRA, strategy: all input errors surface here."""
    t0 = time.perf_counter()
    dtypes = resolve_auto_dtypes(recipe)  # train.dtype / model.dtype: auto -> what this device computes natively
    task = resolve_task(recipe.model)
    with gguf_cache.one_parse_per_file():  # a GGUF read for the tokenizer, the config and the weights: parsed once
        tokenizer = load_tokenizer(recipe.model)
        t1 = time.perf_counter()
        data = build_federated_data(recipe.data, recipe.federation.partition, recipe.federation.num_clients,
                                    tokenizer, recipe.train.max_length, recipe.seed, task)
        refuse_empty_clients(recipe, data)
        t2 = time.perf_counter()
        num_labels = len(data.label_names) if data.label_names else 2
        loaded = load_model(recipe.model, recipe.lora, num_labels=num_labels, seed=recipe.seed,
                            source=recipe.source, tokenizer=tokenizer)
    strategy = with_privacy(get_strategy(recipe.federation.strategy, **recipe.federation.strategy_args), recipe)
    strategy.recipe = recipe
    strategy.training_data = (data.examples, partial(collate, pad_id=loaded.tokenizer.pad_token_id, task=loaded.task),
                              partial(micro_batch_loss, cfg=recipe.train))
    torch.manual_seed(derived_seed(recipe.seed, 0x57A7))
    strategy.setup(loaded.model, [ClientInfo(c, len(ix)) for c, ix in enumerate(data.clients)])
    timings = {"tokenizer_seconds": t1 - t0, "data_seconds": t2 - t1, "model_seconds": time.perf_counter() - t2}
    return Federation(recipe, loaded, data, strategy, strategy.global_keys(loaded.model),
                      {k: round(v, 3) for k, v in timings.items()}, dtypes)


def base_weights(model: torch.nn.Module) -> StateDict:
    """Current values of the LoRA-wrapped base weights (for strategies that change them)."""
    params = {id(p): n for n, p in model.named_parameters()}
    return {params[id(layer.weight)]: layer.weight.detach().clone() for layer in lora_layers(model).values()}


def base_fields(model: torch.nn.Module, strategy: Any, snapshot: bool = False) -> dict[str, Any]:
    """A checkpoint's ``base`` and ``base_history``: the strategy's snapshot-and-log history of its merges when it
    keeps one (a fresh dense snapshot with ``snapshot``, e.g. ``final/``), else the dense base weights when the
    strategy changes them otherwise (FedLoRA-PFL's ``shared: full`` trains them: not low-rank)."""
    from fedllm.runs.base_history import history_of

    history = history_of(strategy)
    if history is not None:
        history.snapshot_next = history.snapshot_next or snapshot
        return {"base": {}, "base_history": history}
    return {"base": base_weights(model) if strategy.modifies_base else {}}


class LocalExecutor:
    """Trains a round's sampled clients in this job: in process, or dealt out over torch.distributed processes.

    The round loop hands "train these clients" to an executor (this one, or
    :class:`fedllm.flower.executor.FlowerExecutor` on Flower's grid); everything else in a round is shared.
    """

    runs_secure_aggregation = True  # privacy.secure_aggregation: secagg_plus (fedllm.engine.secure_rounds)

    def __init__(self) -> None:
        self.dispatch = Dispatch()

    @property
    def is_main(self) -> bool:
        """True in the process that writes files."""
        return self.dispatch.is_main

    def train(self, loop: RoundLoop, rnd: int, sampled: list[int], lr: float,
              bar: Any) -> tuple[list[ClientUpdate], dict[int, int], dict[int, str]]:
        """Train the sampled clients: ``(valid updates, download bytes, {client: why it was dropped})``."""
        recipe, strategy, data = loop.recipe, loop.fed.strategy, loop.fed.data
        comm = recipe.federation.comm_dtype
        updates, down, sent = [], {}, {}
        local = self.dispatch.local_share(sampled)
        secure = None
        if secure_aggregation(recipe.privacy):  # keys and shares go out before training
            try:
                secure = SecureRound(loop, rnd, sampled, local, self.dispatch.exchange)
            except SecAggError as e:  # e.g. a retried sample too small for the threshold: this sample fails
                log.warning("round %d: secure aggregation cannot start: %s", rnd, e)
                return [], {}, {cid: f"secure aggregation cannot start: {e}" for cid in sampled}
        if loop.downlink.enabled:  # on every rank, one with no client of this round too (its residual moves alike)
            loop.downlink.prepare(rnd, loop.global_state)
        for group in client_passes(local, recipe.train, [len(ix) for ix in data.clients]):
            planned = []
            for cid in group:
                plan = strategy.configure_client(rnd, cid, loop.global_state)
                plan.lr = lr
                plan.state = cast(plan.state, comm)
                down[cid] = strategy.download_bytes(plan, comm)
                if loop.downlink.enabled:  # the plan's global tensors travel compressed
                    plain = num_bytes(plan.state, comm)
                    plan.state, wire, _ = loop.downlink.plan_state(plan.state, loop.global_state)
                    down[cid] += wire - plain
                sent[cid] = plan.state
                planned.append((plan, client_faults.expected_upload(strategy, plan, loop.model), loop.store.get(cid)))
            batched = self.train_batched(loop, rnd, planned, bar) if len(planned) > 1 else None
            updates += batched if batched is not None else [self.train_one(loop, rnd, *e, bar) for e in planned]
        if secure is not None:  # a client uploads only its masked change; a dropped one sends nothing
            updates = [u if isinstance(u, client_faults.DroppedUpdate) else secure.mask(u, sent[u.client_id])
                       for u in updates]
        updates, down, changed = self.dispatch.gather(
            updates, down, {u.client_id: loop.store.get(u.client_id) for u in updates})
        loop.store.update(changed)
        strategy.uploads_seen(rnd, client_faults.steps_seen(updates))  # before any is dropped (DP-SGD counts them)
        updates, dropped = client_faults.split_dropped(updates)
        updates = loop.drop_late(rnd, updates, len(sampled), dropped)  # before SecAgg+ unmasks: late = dropout
        if secure is not None:
            updates, lost, loop.secure_record = secure.finish(updates)
            for cid, why in lost.items():
                dropped.setdefault(cid, why)  # a client that failed in training keeps that reason
            protocol_up, protocol_down = secure.protocol_bytes()
            loop.secure_record["protocol_bytes_up"] = {str(c): b for c, b in sorted(protocol_up.items())}
            for u in updates:
                u.wire_bytes += protocol_up.get(u.client_id, 0)
            for cid, extra in protocol_down.items():
                down[cid] = down.get(cid, 0) + extra
        for cid, why in dropped.items():
            log.warning("round %d: client %d dropped: %s", rnd, cid, why)
        return updates, down, dropped

    def train_one(self, loop: RoundLoop, rnd: int, plan: Any, expected: Any, kept: StateDict,
                  bar: Any) -> ClientUpdate:
        """Train one client; a fault makes a :class:`client_faults.DroppedUpdate` (its stored entry is kept)."""
        recipe, data, cid = loop.recipe, loop.fed.data, plan.client_id
        update = None
        try:
            update = run_client(loop.model, plan, loop.fed.strategy, loop.store, data.examples, data.clients[cid],
                                recipe.train, loop.collate, derived_seed(recipe.seed, rnd, cid), bar)
            update.state = cast(update.state, recipe.federation.comm_dtype)
            update.packed = None  # in simulation the read-back upload is handed over (its bytes are counted)
            problem = client_faults.update_problem(update, expected)
        except Exception as e:  # noqa: BLE001 — a client fault: dropped or fatal per federation.on_client_error
            problem = client_faults.describe(e)
        if problem is None:
            return update
        loop.store.put(cid, kept)  # a dropped client keeps the state it had before the round
        steps = update.steps if update is not None else 0  # an upload that arrived was trained and seen
        return client_faults.DroppedUpdate(cid, {}, len(data.clients[cid]), math.nan, steps, reason=problem)

    def train_batched(self, loop: RoundLoop, rnd: int, planned: list[tuple[Any, Any, StateDict]],
                      bar: Any) -> Optional[list]:
        """Train several clients in one pass (``train.clients_per_pass``); None when the pass raised (its
        clients are then trained one by one, so a fault drops only the client that has it)."""
        recipe, data = loop.recipe, loop.fed.data
        plans = [p for p, _, _ in planned]
        try:
            updates = run_clients(loop.model, plans, loop.fed.strategy, loop.store, data.examples,
                                  [data.clients[p.client_id] for p in plans], recipe.train, loop.collate,
                                  [derived_seed(recipe.seed, rnd, p.client_id) for p in plans], bar)
        except Exception as e:  # noqa: BLE001 — retried client by client
            log.warning("round %d: batched pass of clients %s failed (%s); training them one by one",
                        rnd, [p.client_id for p in plans], client_faults.describe(e))
            for plan, _, kept in planned:
                loop.store.put(plan.client_id, kept)
            return None
        out = []
        for update, (plan, expected, kept) in zip(updates, planned, strict=True):
            update.state = cast(update.state, recipe.federation.comm_dtype)
            update.packed = None
            problem = client_faults.update_problem(update, expected)
            if problem is not None:
                loop.store.put(plan.client_id, kept)
                update = client_faults.DroppedUpdate(plan.client_id, {}, len(data.clients[plan.client_id]),
                                                     math.nan, update.steps, reason=problem)
            out.append(update)
        return out

    def prepare(self, loop: RoundLoop) -> None:
        """Before round 1: what clients compute once from the starting model (DPO's reference log-probabilities,
        :mod:`fedllm.engine.reference`), each process its share of the clients, gathered into every store."""
        data = loop.fed.data
        cache = ReferenceCache(loop.run_dir / REFERENCE_CACHE,
                               reference_fingerprint(loop.recipe, [len(ix) for ix in data.clients]), self.is_main)
        precompute_references(loop.model, loop.store, data.examples, dict(enumerate(data.clients)), loop.recipe.train,
                              loop.collate, self.dispatch, cache, loop.progress)

    def sync(self, loop: RoundLoop, rnd: int, sampled: list[int], aggregated: StateDict) -> dict[int, int]:
        """Bytes sent outside the round's plans (the strategy's syncs to non-participants)."""
        fed = loop.recipe.federation
        return loop.fed.strategy.extra_download_bytes(rnd, sampled, fed.num_clients, fed.comm_dtype)

    def state(self) -> dict[str, Any]:
        """What the executor checkpoints (JSON; none here)."""
        return {}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state` returned."""


class RoundLoop:
    """One federated run over a built :class:`Federation`."""

    def __init__(self, fed: Federation, run_dir: Path, progress: bool = True, executor: Any = None):
        self.fed = fed
        self.recipe = fed.recipe
        self.recipe_yaml = dump_recipe(self.recipe)  # the run's recipe.yaml and every checkpoint's (one recipe a run)
        self.run_dir = Path(run_dir)
        self.model = fed.loaded.model
        self.executor = executor if executor is not None else LocalExecutor()
        self.progress = progress and self.recipe.logging.progress and not self.recipe.logging.quiet \
            and self.executor.is_main
        self.collate = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
        self.global_state = read_state(self.model, fed.global_keys)
        self.store = ClientStore()  # per-client state of every client (DESIGN.md §3)
        # the server's compressed download and its residual
        self.downlink = Downlink(self.recipe, fed.strategy.exact_download_keys())
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self.tracking = Tracking([])  # logging.report_to back-ends, started by run() on rank 0
        self.startup: dict[str, Any] = {}  # start-up seconds and what the tokenized-data cache did (summary.json)
        self.accepted_norms: list[float] = []  # update norms of the last round (outlier reference)
        self.final_written = False  # resumed from final/ (stopped before summary.json): only the summary is left
        self.secure_record: dict[str, Any] = {}  # the last round's secure-aggregation figures (metrics.jsonl)
        self.deadline = RoundDeadline.of(self.recipe.federation.round_deadline,
                                         self.recipe.federation.min_clients_per_round)
        self.late: dict[int, float] = {}  # the last round's late clients: {client: arrival seconds}
        self.deadline_s: Optional[float] = None  # the last round's deadline in seconds from its start
        if secure_aggregation(self.recipe.privacy) and not getattr(self.executor, "runs_secure_aggregation", False):
            raise InputError(f"{self.recipe.source}: privacy.secure_aggregation: secagg_plus runs in simulation (one "
                             f"or N processes) and on Flower; {type(self.executor).__name__} does not run it")
        if secure_aggregation(self.recipe.privacy):
            from fedllm.common.registry import strategies

            why = strategies.get(self.recipe.federation.strategy).sum_aggregation_problem()
            if why:  # recipe load refuses it too; a strategy object built otherwise is checked here
                raise InputError(f"{self.recipe.source}: privacy.secure_aggregation: secagg_plus needs a strategy "
                                 f"that aggregates from the sum of the uploads; {self.recipe.federation.strategy} {why}")
        self.fedbuff = FedBuff(self.recipe) if self.recipe.federation.mode == "async" else None
        if self.fedbuff is not None and not (isinstance(self.executor, LocalExecutor)
                                             and self.executor.dispatch.world == 1):
            raise InputError(f"{self.recipe.source}: federation.mode: async runs in simulation in one process "
                             f"(fedllm train); {type(self.executor).__name__} in this job does not run it")
        residual = getattr(getattr(fed.strategy, "base", None), "mode", None) == "dense"  # FRLoRA's hooked residual
        self.throughput = Throughput(self.recipe, self.model, fed.loaded.task, residual,
                                     measure_peak=self.executor.is_main)

    # ----- persistence
    def checkpoint(self, rnd: int, directory: Path, snapshot: bool = False) -> None:
        """Write a checkpoint after round ``rnd`` (``snapshot``: with the base as one dense file, for ``final/``)."""
        if not self.executor.is_main:
            return
        ckpt = ckpt_io.Checkpoint(
            round=rnd, adapter=self.global_state,
            strategy={**self.fed.strategy.state_dict(), **self.downlink.state_dict(rnd),
                      **(self.fedbuff.state_dict() if self.fedbuff else {})},
            clients=self.store.flat(),
            **base_fields(self.model, self.fed.strategy, snapshot),
            meta={"strategy": self.recipe.federation.strategy, "task": self.fed.loaded.task,
                  "model_type": self.fed.loaded.model_type, "label_names": self.fed.data.label_names,
                  "client_sizes": [len(ix) for ix in self.fed.data.clients], "executor": self.executor.state(),
                  **({"async": self.fedbuff.meta()} if self.fedbuff else {})},
            recipe_yaml=self.recipe_yaml)
        ckpt_io.save_checkpoint(directory, ckpt)

    def restore(self, directory: Path) -> None:
        """Continue from a checkpoint: global state, strategy, base weights, per-client state, metrics."""
        ck = ckpt_io.load_checkpoint(directory)
        ckpt_io.restore_into(self.model, self.fed.strategy, ck)
        self.downlink.load_state_dict(ck.strategy)
        order = [k for k in self.fed.global_keys if k in ck.adapter]  # the model's order, as a fresh run reads it:
        self.global_state = {**{k: ck.adapter[k] for k in order}, **ck.adapter}  # DP noise is drawn key by key
        self.store = ckpt_io.client_store(ck)
        self.start_round = ck.round
        self.executor.load_state(ck.meta.get("executor", {}))
        if self.fedbuff is not None:
            self.fedbuff.load(ck.strategy, ck.meta["async"])
        metrics = self.run_dir / "metrics.jsonl"
        if metrics.exists():
            lines = rundir.read_metrics(metrics)
            self.history = [x for x in lines if x.get("round", x.get("resumed_after_round", 0)) <= ck.round]
            if self.executor.is_main:
                ckpt_io.atomic_write_text(metrics, "".join(strict_json.dumps(x) + "\n" for x in self.history))

    def log_round(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.executor.is_main:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(strict_json.dumps(record) + "\n")
            self.tracking.log_round(record)

    # ----- evaluation
    def evaluate(self, rnd: int, records: Optional[list] = None, examples: Optional[list] = None,
                 tag: str = "", reference_policy: bool = False) -> dict[str, float]:
        """The recipe's eval tasks on the model as it is now (held-out data of the run by default);
        ``reference_policy``: that model is the one the held-out pairs' reference log-probabilities were computed
        from (see :func:`fedllm.evaluation.evaluate`)."""
        from fedllm.evaluation import evaluate, prompt_style_for_data
        from fedllm.evaluation.runner import eval_config_for_data

        data = self.fed.data
        out_dir = self.run_dir / "eval" / f"round-{rnd:04d}" if self.executor.is_main else None
        if examples is None:  # the held-out pairs carry their reference log-probabilities (DPO)
            examples = with_reference(data.eval_examples, range(len(data.eval_examples)),
                                      self.store.reference(HELD_OUT))
        dpo = self.recipe.train.preference if self.recipe.train.objective == "dpo" else None
        return evaluate(self.model, self.fed.loaded.tokenizer, eval_config_for_data(self.recipe.eval,
                                                                                      self.recipe.data), out_dir,
                        records=data.eval_records if records is None else records,
                        eval_examples=examples, tag=tag,
                        prompt_style=prompt_style_for_data(self.recipe.data, self.recipe.eval), progress=self.progress,
                        preference=dpo, reference_policy=reference_policy)

    def evaluate_personal(self, rnd: int) -> dict[str, dict[str, float]]:
        """Each client's personal model (``Strategy.personal_state``) on its own held-out split."""
        data, out = self.fed.data, {}
        for cid in range(self.recipe.federation.num_clients):
            personal = self.fed.strategy.personal_state(cid, self.store.get(cid))
            if personal is None or not (data.client_eval[cid] or data.client_eval_records[cid]):
                continue
            saved = read_state(self.model, personal.keys())
            write_state(self.model, personal)
            try:
                examples = with_reference(data.client_eval[cid], range(len(data.client_eval[cid])),
                                          self.store.reference(cid), EVAL_REFERENCE_KEY)
                out[str(cid)] = self.evaluate(rnd, data.client_eval_records[cid], examples, tag=f"client-{cid}")
            finally:
                write_state(self.model, saved)
        return out

    # ----- one round
    def aggregate(self, rnd: int, updates: list[ClientUpdate]) -> StateDict:
        """The round's aggregation: ``aggregate`` then ``after_aggregate``; returns what ``aggregate`` gave."""
        strategy = self.fed.strategy
        strategy.downloaded = self.downlink.received(rnd)  # what the clients started from (compressed download)
        try:
            if updates and isinstance(updates[0], SummedUpdate):  # secure aggregation: only the round's mean is known
                aggregated = strategy.aggregate_mean(rnd, self.global_state, updates[0].state, updates)
            elif not updates:  # every sampled client was empty (weight 0): the global state stays as it was
                aggregated = dict(self.global_state)
            else:
                aggregated = strategy.aggregate(rnd, self.global_state, updates)
            self.refuse_non_finite(rnd, aggregated)
            self.global_state = strategy.after_aggregate(rnd, self.model, aggregated)
        finally:
            strategy.downloaded = None
        self.downlink.forget(strategy.reinitialised_at(rnd))
        self.refuse_non_finite(rnd, self.global_state)
        write_state(self.model, self.global_state)
        return aggregated

    def refuse_non_finite(self, rnd: int, state: StateDict) -> None:
        """Stop the run (no checkpoint of this round) when the aggregated ``state`` holds a nan/inf."""
        key = client_faults.non_finite_key(state)
        if key is not None:
            raise client_faults.RoundStopped(
                f"round {rnd}: the aggregate is not finite ({key}); nothing of round {rnd} is checkpointed, the "
                "newest checkpoint holds an earlier round (fix the cause, then --resume)")

    def screen_updates(self, rnd: int, updates: list[ClientUpdate], dropped: dict[int, str],
                       before: dict[int, StateDict]) -> list[ClientUpdate]:
        """Drop the updates whose norm is out of bounds (:func:`client_faults.norm_outliers`) into ``dropped``;
        their clients keep the per-client state they had before the round."""
        fed = self.recipe.federation
        norms = {u.client_id: client_faults.update_norm(u.state, self.global_state) for u in updates}
        outliers = client_faults.norm_outliers(norms, fed.max_update_norm, fed.update_outlier_factor,
                                               self.accepted_norms, self.fed.strategy.outlier_scale())
        for cid, why in outliers.items():
            log.warning("round %d: client %d dropped: %s", rnd, cid, why)
            self.store.put(cid, before[cid])
            dropped[cid] = why
        kept = [u for u in updates if u.client_id not in outliers]
        self.accepted_norms = [norms[u.client_id] for u in kept] or self.accepted_norms
        return kept

    def drop_late(self, rnd: int, updates: list[ClientUpdate], sampled: int, dropped: dict[int, str],
                  silent: tuple[int, ...] = ()) -> list[ClientUpdate]:
        """The round deadline (``federation.round_deadline``, :mod:`fedllm.engine.round_deadline`): the updates that
        arrived in time; each late client (and each ``silent`` one, whose upload had not arrived when a transport
        stopped waiting at the deadline) goes into ``dropped`` and :attr:`late`. Its per-client state is put back
        as it was before the round by :meth:`run_round`."""
        self.late, self.deadline_s = {}, None
        if self.deadline is None or not (updates or silent):
            return updates
        arrivals = {u.client_id: arrival_seconds(u) for u in updates} | dict.fromkeys(silent, math.inf)
        self.late, self.deadline_s = self.deadline.late(arrivals, sampled)
        for cid, t in self.late.items():
            dropped[cid] = (f"late: its upload arrived {t:.3f} s into the round, after the deadline "
                            f"{self.deadline_s:.3f} s" if math.isfinite(t) else
                            f"late: no upload by the round's deadline {self.deadline_s:.3f} s")
        return [u for u in updates if u.client_id not in self.late]

    def stop(self, rnd: int, why: str) -> None:
        """End the run in round ``rnd`` without aggregating: checkpoint the state after round ``rnd - 1``."""
        write_state(self.model, self.global_state)
        where = ckpt_io.round_dir(self.run_dir, rnd - 1)
        self.checkpoint(rnd - 1, where)
        raise client_faults.RoundStopped(f"round {rnd}: {why}; nothing was aggregated and the state after round "
                                         f"{rnd - 1} is checkpointed in {where} (fix the cause, then --resume)")

    def run_round(self, rnd: int, bar: Any) -> dict[str, Any]:
        recipe, strategy, fed = self.recipe, self.fed.strategy, self.recipe.federation
        comm = fed.comm_dtype
        t0 = time.perf_counter()
        lr = round_lr(recipe, rnd)
        if self.fedbuff is not None:  # federation.mode: async: a round is one buffered server step
            return self.finish_record(rnd, self.fedbuff.run_round(self, rnd, lr, bar), t0)
        retries: list[dict[str, Any]] = []
        failed: set[int] = set()
        why = strategy.round_problem(rnd)
        if why:
            self.stop(rnd, why)
        retries_allowed = fed.round_retries if strategy.resample_on_drops else 0  # not under client-level DP
        for attempt in range(retries_allowed + 1):
            why = strategy.round_problem(rnd) if attempt else None  # the discarded sample's uploads spent budget
            if why:
                self.stop(rnd, why)
            sampled = sample_clients(strategy.sampling_seed(recipe.seed), rnd, fed.num_clients,
                                     recipe.sampled_per_round(), attempt, frozenset(failed))
            before = {cid: self.store.get(cid) for cid in sampled}
            self.late, self.deadline_s = {}, None  # set by drop_late, which the executor calls
            empty = empty_clients(self.fed.data, sampled)  # no records: nothing to train, nothing sent
            training = [cid for cid in sampled if cid not in empty]
            updates, down, dropped = self.executor.train(self, rnd, training, lr, bar) if training else ([], {}, {})
            for cid in self.late:  # a late client keeps its state from before the round: its next starts afresh
                self.store.put(cid, before[cid])
            if not secure_aggregation(recipe.privacy):  # the server sees no single update to measure
                updates = self.screen_updates(rnd, updates, dropped, before)
            needed = min(fed.min_clients_per_round, len(training)) if empty else fed.min_clients_per_round
            if len(updates) >= needed and not (dropped and fed.on_client_error == "fail"):
                dropped.update(empty)
                break
            self.store.update(before)  # nothing of this sample is kept
            failed.update(dropped)
            if dropped and fed.on_client_error == "fail":
                self.stop(rnd, "; ".join(f"client {c} {why}" for c, why in dropped.items())
                          + " (federation.on_client_error=fail)")
            retries.append({"clients": sampled, "dropped": {str(c): why for c, why in dropped.items()},
                            "bytes_down_total": sum(down.values())})
            log.warning("round %d: %d valid update(s) of %d, fewer than federation.min_clients_per_round=%d%s",
                        rnd, len(updates), len(sampled), fed.min_clients_per_round,
                        "; trying a fresh sample" if attempt < retries_allowed else "")
        else:
            self.stop(rnd, f"fewer than federation.min_clients_per_round={fed.min_clients_per_round} valid updates "
                           + (f"in each of {retries_allowed + 1} samples" if strategy.resample_on_drops else
                              "(not retried under client-level DP: which clients failed would pick a second sample)"))
        aggregated = self.aggregate(rnd, updates)
        for cid, extra in self.executor.sync(self, rnd, sampled, aggregated).items():
            down[cid] = down.get(cid, 0) + extra
        up = {u.client_id: u.wire_bytes if u.wire_bytes is not None else num_bytes(u.state, comm) for u in updates}
        record = {
            "round": rnd, "clients": sampled, "lr": lr,
            "client_loss": {str(u.client_id): u.loss for u in updates},
            "client_steps": {str(u.client_id): u.steps for u in updates},
            "bytes_up": {str(c): b for c, b in up.items()}, "bytes_down": {str(c): b for c, b in down.items()},
            "bytes_up_total": sum(up.values()), "bytes_down_total": sum(down.values()),
            "train_loss": released_mean_loss(updates),
            "padded_fraction": padded_fraction(updates),
            "throughput": self.throughput.round_record(updates),
        }
        if any(u.loss is None for u in updates):  # not uploaded (DP-SGD: no noise protects a client's loss)
            del record["client_loss"], record["train_loss"]
        elif not updates:  # every sampled client was empty: no loss
            del record["train_loss"]
        record.update(strategy.round_record(rnd))
        if secure_aggregation(recipe.privacy):
            record["secure_aggregation"] = self.secure_record
        if dropped:
            record["dropped"] = {str(c): why for c, why in dropped.items()}
        if self.deadline_s is not None:
            record["round_deadline_s"] = round(self.deadline_s, 3) if math.isfinite(self.deadline_s) else None
            record["late"] = {str(c): round(t, 3) if math.isfinite(t) else None for c, t in sorted(self.late.items())}
        if client_stats.withheld(recipe):  # SecAgg+ / client-level DP: totals only (privacy.per_client_stats)
            record = client_stats.round_entries(record)
        if retries:
            record["retries"] = retries
            record["bytes_down_total"] += sum(r["bytes_down_total"] for r in retries)
        return self.finish_record(rnd, record, t0)

    def finish_record(self, rnd: int, record: dict[str, Any], t0: float) -> dict[str, Any]:
        """The round's evaluations (when due) and seconds, added to its ``record``."""
        recipe, strategy = self.recipe, self.fed.strategy
        if eval_due(recipe.eval, rnd, recipe.federation.rounds):
            record["eval"] = self.evaluate(rnd)
            if recipe.eval.personal and strategy.personalized:
                record["personal_eval"] = self.evaluate_personal(rnd)
                record["personal_eval_stats"] = personal_stats(record["personal_eval"])
        record["seconds"] = round(time.perf_counter() - t0, 3)
        return record

    def run(self) -> RunResult:
        """Train the remaining rounds; experiment trackers (``logging.report_to``) see every record, on rank 0."""
        if self.executor.is_main:
            self.tracking = Tracking(self.recipe.logging.report_to)
            self.tracking.start(self.run_dir, self.recipe.to_dict(), self.recipe_yaml)
        try:
            return self._run()
        finally:
            self.tracking.finish()

    def _run(self) -> RunResult:
        recipe = self.recipe
        rounds = recipe.federation.rounds
        if self.start_round == 0:  # from the model as training starts: DPO's reference log-probabilities
            if hasattr(self.executor, "prepare"):
                self.executor.prepare(self)
            data = self.fed.data
            precompute_eval_references(self.model, self.store, data.eval_examples, data.client_eval, recipe,
                                       self.collate)
        if self.start_round == 0 and eval_due(recipe.eval, 0, rounds):  # the model the references were computed from
            self.log_round({"round": 0, "eval": self.evaluate(0, reference_policy=True)})
            self.say(f"before training: {_format_metrics(self.history[-1]['eval'])}")
        sizes = [len(ix) for ix in self.fed.data.clients]
        steps_round = sum(sorted((steps_per_round(recipe.train, n) for n in sizes), reverse=True)
                          [:recipe.sampled_per_round()])
        bar = tqdm(total=(rounds - self.start_round) * steps_round, desc="client steps", unit="step",
                   disable=not self.progress, leave=False)
        for rnd in range(self.start_round + 1, rounds + 1):
            record = self.run_round(rnd, bar)
            self.log_round(record)
            eta = run_eta(self.history, rounds)
            bar.set_postfix_str(f"run ETA {eta}", refresh=True)
            self.say(f"round {rnd}/{rounds}  clients={record['clients']}  loss={_loss(record)}  "
                     f"up={record['bytes_up_total'] / 1024**2:.2f}MB  down={record['bytes_down_total'] / 1024**2:.2f}MB  "
                     f"{record['seconds']:.1f}s  {round_text(record.get('throughput'))}  ETA {eta}  "
                     f"{_format_metrics(record.get('eval', {}))}".rstrip()
                     + "".join(f"\n  client {c} dropped: {why}" for c, why in record.get("dropped", {}).items()))
            if recipe.checkpoint.every and rnd % recipe.checkpoint.every == 0 and rnd < rounds:
                self.checkpoint(rnd, ckpt_io.round_dir(self.run_dir, rnd))
                if self.executor.is_main:
                    ckpt_io.prune(self.run_dir, recipe.checkpoint.keep_last)
        bar.close()
        if self.start_round < rounds or not self.final_written:
            self.checkpoint(rounds, self.run_dir / "final", snapshot=True)
        if self.executor.is_main:
            summary = self.write_summary()
            write_run_plot(self.run_dir)
            self.say(comm_budget.summary_line(summary["communication"]))
            if summary["initial_eval"] and summary["final_eval"]:
                self.say("eval before -> after: " + "  ".join(
                    f"{k} {summary['initial_eval'][k]:.4g} -> {v:.4g}" for k, v in summary["final_eval"].items()
                    if k in summary["initial_eval"]))
        return RunResult(self.run_dir, self.history, self.global_state, self.fed.strategy,
                         self.model, self.fed.loaded.tokenizer, clients=self.store)

    def say(self, line: str) -> None:
        """A one-line progress message (not with --quiet, only on rank 0)."""
        if not self.recipe.logging.quiet and self.executor.is_main:
            tqdm.write(line, file=sys.stderr)

    def write_summary(self) -> dict[str, Any]:
        rounds = [h for h in self.history if h.get("round", 0) > 0]
        evals = [h for h in self.history if "eval" in h]
        personal = [h for h in self.history if h.get("personal_eval")]
        summary = {
            "rounds": len(rounds), "strategy": self.recipe.federation.strategy,
            "bytes_up_total": sum(h["bytes_up_total"] for h in rounds),
            "bytes_down_total": sum(h["bytes_down_total"] for h in rounds),
            "final_train_loss": rounds[-1].get("train_loss") if rounds else None,
            "initial_eval": evals[0]["eval"] if evals and evals[0]["round"] == 0 else None,
            "final_eval": evals[-1]["eval"] if evals else None,
            "final_personal_eval": personal[-1]["personal_eval"] if personal else None,
            "final_personal_eval_stats": personal_stats(personal[-1]["personal_eval"]) if personal else None,
            "seconds": round(sum(h.get("seconds", 0) for h in rounds), 3),
            "threads": threads.in_effect(),
            "dtype": self.fed.dtypes or {"train": self.recipe.train.dtype, "model": self.recipe.model.dtype},
            "compile": compile_choice(self.recipe.train, next(self.model.parameters()).device.type),  # as run
            "throughput": self.throughput.run_summary(rounds),
            "startup_seconds": self.startup.get("seconds"), "startup": self.startup,
            "dropped": {str(h["round"]): h["dropped"] for h in rounds if h.get("dropped")},
            "late": {str(h["round"]): sorted(int(c) for c in h["late"]) for h in rounds if h.get("late")},
            **{k: rounds[-1][k] for k in ("epsilon", "client_epsilon", "privacy") if rounds and k in rounds[-1]},
        }
        budget = self.recipe.federation.communication_budget_mb
        summary["communication"] = comm_budget.usage(summary["bytes_up_total"] + summary["bytes_down_total"], budget)
        if budget is not None and not summary["communication"]["within_budget"]:
            log.warning(comm_budget.over_budget_warning(summary["communication"]["total_mb"], budget, projected=False))
        ckpt_io.atomic_write_text(self.run_dir / "summary.json", strict_json.dumps(summary, indent=2))
        return summary


def released_mean_loss(updates: list) -> Optional[float]:
    """The example-weighted mean of the clients' uploaded losses (None when a client uploaded none)."""
    if not updates or any(u.loss is None for u in updates):
        return None
    return sum(u.loss * u.num_examples for u in updates) / sum(u.num_examples for u in updates)


def padded_fraction(updates: list) -> float:
    """Share of the round's trained positions that were padding (over every client's micro-batches)."""
    positions = sum(u.padding[1] for u in updates)
    return round(sum(u.padding[0] for u in updates) / positions, 6) if positions else 0.0


def run_eta(history: list[dict[str, Any]], rounds: int) -> str:
    """Time left for the run as ``m:ss``: mean seconds of the rounds done so far x rounds left."""
    done = [h["seconds"] for h in history if h.get("round", 0) > 0 and "seconds" in h]
    last = max((h.get("round", 0) for h in history), default=0)
    left = max(0, rounds - last) * (sum(done) / len(done) if done else 0.0)
    return f"{int(left // 60)}:{int(left % 60):02d}"


def write_run_plot(run_dir: Path) -> None:
    """``plot.png`` beside ``summary.json`` (a failure to draw is a warning, never a failed run)."""
    try:
        from fedllm.runs.plot import plot_runs

        plot_runs([run_dir], run_dir / "plot.png")
    except Exception as e:  # noqa: BLE001 — matplotlib missing or a drawing error must not lose the run
        log.warning("could not write %s: %s: %s", run_dir / "plot.png", type(e).__name__, e)


def _loss(record: dict[str, Any]) -> str:
    return f"{record['train_loss']:.4f}" if "train_loss" in record else "n/a"  # DP-SGD: not uploaded


def _format_metrics(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def prepare_run_dir(recipe: Recipe, fed: Federation, resume: bool, overwrite: bool) -> Optional[Path]:
    """Check the run directory (see :mod:`fedllm.runs.rundir`); the checkpoint to resume from, if any."""
    return rundir.prepare_run_dir(recipe, resume, overwrite, is_main=int(os.environ.get("RANK", "0")) == 0)


def run(recipe: Recipe, resume: bool = False, overwrite: bool = False, progress: bool = True,
        executor: Any = None) -> RunResult:
    """Run a federated recipe end to end and return its :class:`RunResult`.

    ``executor`` trains each round's clients (default: :class:`LocalExecutor`, in this job). The run
    directory's lock (:mod:`fedllm.runs.runlock`) is held throughout: a second writer is refused.
    """
    with runlock.hold(recipe.output_dir, enabled=int(os.environ.get("RANK", "0")) == 0):
        return _run_locked(recipe, resume, overwrite, progress, executor)


def _run_locked(recipe: Recipe, resume: bool, overwrite: bool, progress: bool, executor: Any) -> RunResult:
    if recipe.train.threads is not None or threads.chosen() is not None:  # else: the caller's torch settings
        threads.apply(recipe.train.threads)
    t0 = time.perf_counter()
    if int(os.environ.get("RANK", "0")) == 0:  # refuse at once, before the model is built; rank 0 alone, as
        rundir.check_run_dir(recipe, resume, overwrite)  # the others could already see the run it starts writing
    fed = build_federation(recipe)
    start_from = prepare_run_dir(recipe, fed, resume, overwrite)
    changed = check_resume_recipe(Path(recipe.output_dir), recipe) if start_from is not None else {}
    done = json.loads((start_from / ckpt_io.META).read_text())["round"] if start_from is not None else 0
    if done > recipe.federation.rounds:
        raise RunDirError(f"{recipe.source}: federation.rounds={recipe.federation.rounds}, but {start_from} is of "
                          f"round {done}; give federation.rounds >= {done}")
    loop = RoundLoop(fed, Path(recipe.output_dir), progress, executor)
    if loop.executor.is_main:
        rundir.mark_run_dir(loop.run_dir)
        ckpt_io.atomic_write_text(loop.run_dir / "recipe.yaml", loop.recipe_yaml)
        ckpt_io.atomic_write_text(loop.run_dir / "partition.json", json.dumps(redact(fed.data.manifest), indent=1))
    if start_from is not None:
        loop.restore(start_from)
        loop.final_written = start_from.name == "final"
        log.info("resuming %s from round %d", loop.run_dir, loop.start_round)
        if changed:
            log.warning("resuming with changed keys (allowed: they do not change what a round computes): %s",
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
            loop.log_round({"resumed_after_round": loop.start_round, "changed": changed})
    loop.startup = {"seconds": round(time.perf_counter() - t0, 3), **fed.timings,
                    "tokenized_cache": fed.data.cache_info}
    return loop.run()
