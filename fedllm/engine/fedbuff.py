"""Buffered asynchronous aggregation (``federation.mode: async``): FedBuff (Nguyen et al., AISTATS 2022, Alg. 1).

``M`` clients (``federation.async_concurrency``) train at once, each from the global model of the server version
it pulled; a client's upload is its change ``Δ_i = θ_i − θ_pulled``. The server adds each arriving upload to its
buffer weighted by its staleness, ``Δ̄ += s(τ_i)·Δ_i`` with ``τ_i`` = server version now − the version pulled and
``s(τ) = 1/√(1+τ)`` (``federation.async_staleness``); when ``K`` uploads (``federation.async_buffer_size``) are
buffered the server steps with ``Δ̄/K`` and empties the buffer. A client that finished is replaced at once by a
fresh one, sampled uniformly from the clients not training. One round of the round loop is one server step
(``federation.rounds`` counts server steps, ``train.lr``'s schedule runs over them).

The server step is the strategy's: the round loop hands it ``θ + Δ̄/K`` as the round's mean upload
(:meth:`fedllm.strategies.base.Strategy.aggregate_mean`), so FedAvg takes it (``η_g = 1``; fedavgm's
``server_learning_rate`` is FedBuff's ``η_g``) and FedAdam, FedYogi, FedAdagrad, FedAvgM take ``Δ̄/K`` as their
pseudo-gradient. The buffer is unweighted by example counts, as the paper's.

Asynchrony is simulated in this process on a deterministic virtual clock: a client's training takes its measured
optimizer steps x ``federation.async_step_seconds`` of that client, so the arrival order is reproducible and
independent of the machine's load (ties: the client dispatched first arrives first). A client is trained when it is
dispatched (its result depends only on the version it pulled and its own data), and its upload waits, in flight,
for its arrival time. The in-flight uploads, the clock and the pending dispatch are checkpointed with each round, so
a resumed run continues bit-exactly. ``metrics.jsonl`` records per server step the uploads aggregated (client,
version pulled, staleness, weight, arrival) and the virtual time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from fedllm.engine.secure_rounds import SummedUpdate
from fedllm.models.state import StateDict, cast, num_bytes
from fedllm.recipe.schedule import derived_seed, step_seconds
from fedllm.recipe.schema import Recipe
from fedllm.runs.checkpoint import ASYNC_BUFFER

STALENESS: dict[str, Callable[[int, float], float]] = {
    "sqrt": lambda tau, a: 1.0 / math.sqrt(1.0 + tau),  # the paper's s(τ)
    "constant": lambda tau, a: 1.0,
    "polynomial": lambda tau, a: (1.0 + tau) ** -a,
}
"""``federation.async_staleness``: the weight ``s(τ)`` of an upload ``τ`` server steps stale (``a``: the exponent)."""


@dataclass
class InFlight:
    """A dispatched client's upload, waiting for its arrival on the virtual clock."""

    client_id: int
    pulled: int  # the server version it trained from (server steps done when it was dispatched)
    sequence: int  # dispatch order (breaks ties of arrival)
    start_s: float
    arrival_s: float
    delta: StateDict  # θ_i − θ_pulled, fp32
    num_examples: int
    loss: float | None
    steps: int
    work: dict[str, Any]  # what its training did (tokens, seconds: fedllm.models.flops.TrainedWork)

    def meta(self) -> dict[str, Any]:
        """Everything but the change (JSON, for the checkpoint)."""
        return {k: v for k, v in vars(self).items() if k != "delta"}


class FedBuff:
    """The asynchronous server of one run: in-flight clients, the virtual clock, the staleness weights."""

    def __init__(self, recipe: Recipe):
        fed = recipe.federation
        self.recipe = recipe
        self.buffer_size = fed.async_buffer_size or recipe.sampled_per_round()
        self.concurrency = fed.async_concurrency or fed.num_clients
        self.step_seconds = step_seconds(fed)
        self.exponent = fed.async_staleness_exponent
        self.staleness_fn = STALENESS[fed.async_staleness]
        self.clock = 0.0
        self.sequence = 0
        self.in_flight: list[InFlight] = []
        self.pending: list[float] = [0.0] * self.concurrency  # start times of slots to fill at the next round
        self.round_start: tuple = ()  # the state a server step started from (what a stopped step checkpoints)

    def weight(self, staleness: int) -> float:
        """``s(τ)``."""
        return self.staleness_fn(staleness, self.exponent)

    def describe(self) -> str:
        """What the asynchronous server does, in one line (``--dry-run``)."""
        s = {"sqrt": "1/sqrt(1+tau)", "constant": "1", "polynomial": f"(1+tau)^-{self.exponent:g}"}
        return (f"async (FedBuff): {self.concurrency} client(s) train at once; a server step (a round) every "
                f"{self.buffer_size} upload(s), each weighted by its staleness s(tau) = "
                f"{s[self.recipe.federation.async_staleness]}; virtual seconds per local step "
                f"{sorted(set(self.step_seconds))}")

    # ----- one server step
    def run_round(self, loop: Any, rnd: int, lr: float, bar: Any) -> dict[str, Any]:
        """Dispatch, let uploads arrive until ``K`` are buffered, step the server: the round's metrics record."""
        version = rnd - 1
        self.round_start = (list(self.in_flight), self.clock, self.sequence, list(self.pending), {})
        excluded: set[int] = set()  # clients dispatched in this round (a second dispatch would repeat the first)
        down: dict[int, int] = {}
        dropped: dict[str, str] = {}
        dispatched: list[dict[str, Any]] = []
        for start in self.pending:
            self.dispatch(loop, rnd, start, lr, bar, excluded, down, dropped, dispatched)
        self.pending = []
        buffer: list[InFlight] = []
        while len(buffer) < self.buffer_size:
            if not self.in_flight:
                self.stop(loop, rnd, f"no client left training (dropped: {dropped})")
            arrived = min(self.in_flight, key=lambda f: (f.arrival_s, f.sequence))
            self.in_flight.remove(arrived)
            self.clock = arrived.arrival_s
            buffer.append(arrived)
            if len(buffer) < self.buffer_size:  # its replacement pulls this version
                self.dispatch(loop, rnd, self.clock, lr, bar, excluded, down, dropped, dispatched)
            else:  # the K-th: its replacement starts after the server step, from the next version
                self.pending = [self.clock]
        weights = [self.weight(version - f.pulled) for f in buffer]
        loop.aggregate(rnd, [self.summed(self.buffered_mean(loop.global_state, buffer, weights), buffer)])
        comm = self.recipe.federation.comm_dtype
        up = {}
        for f in buffer:
            up[f.client_id] = up.get(f.client_id, 0) + num_bytes(f.delta, comm)
        record = {
            "round": rnd, "clients": [f.client_id for f in buffer], "lr": lr,
            "client_loss": {str(f.client_id): f.loss for f in buffer},
            "client_steps": {str(f.client_id): f.steps for f in buffer},
            "bytes_up": {str(c): b for c, b in up.items()}, "bytes_down": {str(c): b for c, b in down.items()},
            "bytes_up_total": sum(up.values()), "bytes_down_total": sum(down.values()),
            "throughput": loop.throughput.round_record(buffer),
            "train_loss": sum(f.loss for f in buffer) / len(buffer) if all(f.loss is not None for f in buffer)
            else None,
            "async": {"version": rnd, "virtual_time_s": self.clock, "dispatched": dispatched,
                      "aggregated": [{"client": f.client_id, "pulled": f.pulled, "staleness": version - f.pulled,
                                      "weight": w, "start_s": f.start_s, "arrival_s": f.arrival_s}
                                     for f, w in zip(buffer, weights, strict=True)],
                      "in_flight": sorted(f.client_id for f in self.in_flight)},
        }
        if record["train_loss"] is None:
            del record["train_loss"], record["client_loss"]
        if dropped:
            record["dropped"] = dropped
        return record

    def buffered_mean(self, global_state: StateDict, buffer: list[InFlight], weights: list[float]) -> StateDict:
        """``θ + Δ̄/K`` with ``Δ̄ = Σ s(τ_i)·Δ_i`` (fp32, cast back to each tensor's dtype)."""
        out = {}
        for k, v in global_state.items():
            total = torch.zeros_like(v, dtype=torch.float32)
            for f, w in zip(buffer, weights, strict=True):
                total += w * f.delta[k]
            out[k] = (v.float() + total / len(buffer)).to(v.dtype)
        return out

    @staticmethod
    def summed(mean: StateDict, buffer: list[InFlight]) -> SummedUpdate:
        """The buffer as the round loop aggregates it: one upload carrying ``θ + Δ̄/K``, the round's mean, which the
        strategy steps from (:meth:`fedllm.strategies.base.Strategy.aggregate_mean`) as from SecAgg+'s mean."""
        return SummedUpdate(-1, mean, sum(f.num_examples for f in buffer), None, sum(f.steps for f in buffer))

    def dispatch(self, loop: Any, rnd: int, start: float, lr: float, bar: Any, excluded: set[int],
                 down: dict[int, int], dropped: dict[str, str], dispatched: list[dict[str, Any]]) -> None:
        """Sample a client not training (nor dispatched this round, where one is left), train it from the current
        global state and put its upload in flight; a client that fails is replaced at the same start time."""
        num_clients = self.recipe.federation.num_clients
        for _ in range(num_clients):
            busy = {f.client_id for f in self.in_flight}
            eligible = [c for c in range(num_clients) if c not in busy and c not in excluded] or \
                [c for c in range(num_clients) if c not in busy]
            gen = torch.Generator().manual_seed(derived_seed(self.recipe.seed, rnd, 0xFB, self.sequence))
            cid = eligible[int(torch.randint(len(eligible), (1,), generator=gen))]
            self.sequence += 1
            excluded.add(cid)
            sent = cast(loop.global_state, self.recipe.federation.comm_dtype)
            before = {cid: loop.store.get(cid)}
            self.round_start[4].setdefault(cid, before[cid])
            updates, sent_bytes, failed = loop.executor.train(loop, rnd, [cid], lr, bar)
            updates = loop.screen_updates(rnd, updates, failed, before)
            down[cid] = down.get(cid, 0) + sent_bytes.get(cid, 0)
            if not updates:
                dropped[str(cid)] = failed.get(cid, "no upload")
                if self.recipe.federation.on_client_error == "fail":
                    self.stop(loop, rnd, f"client {cid} {dropped[str(cid)]} (federation.on_client_error=fail)")
                continue
            u = updates[0]
            seconds = u.steps * self.step_seconds[cid]
            self.in_flight.append(InFlight(cid, rnd - 1, self.sequence - 1, start, start + seconds,
                                           {k: u.state[k].float() - sent[k].float() for k in sent},
                                           u.num_examples, u.loss, u.steps,
                                           dict(u.work) if isinstance(u.work, dict) else vars(u.work)))
            dispatched.append({"client": cid, "start_s": start, "arrival_s": start + seconds})
            return

    def stop(self, loop: Any, rnd: int, why: str) -> None:
        """End the run in server step ``rnd`` (:meth:`fedllm.engine.server.RoundLoop.stop`), its checkpoint holding
        the buffer as the step found it: the clients in flight then, the clock, and the per-client state of every
        client dispatched since."""
        self.in_flight, self.clock, self.sequence, self.pending, kept = self.round_start
        loop.store.update(kept)
        loop.stop(rnd, why)

    # ----- checkpoint
    def state_dict(self) -> StateDict:
        """The in-flight changes, under :data:`fedllm.runs.checkpoint.ASYNC_BUFFER` (checkpoint tensors)."""
        return {f"{ASYNC_BUFFER}{f.sequence}/{k}": v for f in self.in_flight for k, v in f.delta.items()}

    def meta(self) -> dict[str, Any]:
        """The clock, the pending dispatch and the in-flight clients (checkpoint JSON)."""
        return {"clock": self.clock, "sequence": self.sequence, "pending": self.pending,
                "in_flight": [f.meta() for f in self.in_flight]}

    def load(self, tensors: StateDict, meta: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` and :meth:`meta`."""
        self.clock, self.sequence, self.pending = meta["clock"], meta["sequence"], list(meta["pending"])
        self.in_flight = []
        for m in meta["in_flight"]:
            prefix = f"{ASYNC_BUFFER}{m['sequence']}/"
            delta = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
            self.in_flight.append(InFlight(**m, delta=delta))
