"""One adapter from fedllm's Strategy hooks to Flower's message-based strategy interface.

:class:`FedllmStrategy` is a ``flwr.serverapp.strategy.Strategy`` around a fedllm round loop:
``configure_train`` turns :meth:`Strategy.configure_client` plans into Flower messages (one per sampled
client, to the SuperNode serving it, with the rounds of aggregates it missed), ``aggregate_train`` turns
the replies into :class:`ClientUpdate` objects and runs the round loop's aggregation
(:meth:`fedllm.engine.server.RoundLoop.aggregate`: ``aggregate`` then ``after_aggregate``). No algorithm is
written here: every strategy runs unchanged. The client side is :mod:`fedllm.flower.client_app`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from fedllm.flower import records
from fedllm.flower.node import DOWNLOAD_PREFIX, needs_sync, phases_json, replays_after_aggregate
from fedllm.models.state import StateDict, cast
from fedllm.strategies.base import ClientUpdate

log = logging.getLogger("fedllm")


NO_REPLY = "no reply within the timeout"


class ClientFailed(RuntimeError):
    """A SuperNode answered with an error (its ClientApp raised)."""


class FedllmStrategy(FlowerStrategy):
    """fedllm's hooks on Flower's ``configure_train`` / ``aggregate_train``.

    Args:
        loop: the :class:`fedllm.engine.server.RoundLoop` whose strategy, global state and model it serves.
        token: identifies the run on the nodes (their state folder); kept across server restarts.
    """

    def __init__(self, loop: Any, token: str):
        self.loop = loop
        self.token = token
        self.strategy = loop.fed.strategy
        self.comm = loop.recipe.federation.comm_dtype
        self.nodes: dict[int, int] = {}  # client id -> Flower node id
        self.synced: dict[int, int] = {}  # client id -> last round whose aggregate its node applied
        self.steps: dict[int, int] = {}  # client id -> newest round after which its node saved its state
        self.sent: dict[int, int] = {}  # node id -> client id of the messages in flight
        self.origin: dict[str, int] = {}  # message id -> node id it went to (for the SuperLink's error replies)
        self.sync_needed = needs_sync(self.strategy)
        self.sync_dir = Path(loop.run_dir) / "flower" / "sync"
        self.bytes_down: dict[int, int] = {}
        self.expected: dict[int, Any] = {}  # the upload layout each sampled client must send
        self.received: dict[int, StateDict] = {}  # what each sampled client received (its upload's reference)

    # ----- aggregates the nodes must replay (catch-up)
    def keep_aggregate(self, rnd: int, aggregated: StateDict) -> None:
        """Keep what the nodes replay for round ``rnd`` until every node has applied it: the aggregate (as the
        wire carries it) for ``after_aggregate`` (with the round's compressed download, codes and absmax, when
        ``after_aggregate`` reads it: FRLoRA's merge), the round's logged low-rank merges for a strategy that changes
        the base in ``aggregate``."""
        import os

        from safetensors.torch import save_file

        from fedllm.runs.base_history import history_of, merges_to_state

        if not self.sync_needed:
            return
        kept = dict(cast(aggregated, self.comm)) if replays_after_aggregate(self.strategy) else {}
        if replays_after_aggregate(self.strategy) and self.strategy.after_aggregate_reads_download \
                and self.loop.downlink.received(rnd) is not None:  # the round's compressed download, as sent
            for key, p in self.loop.downlink.packed.items():
                kept[f"{DOWNLOAD_PREFIX}{key}/codes"], kept[f"{DOWNLOAD_PREFIX}{key}/absmax"] = p.codes, p.absmax
        history = history_of(self.strategy)
        if getattr(self.strategy, "merges_in_aggregate", False) and history is not None:
            kept.update(merges_to_state(history.round_merges(rnd)))
        self.sync_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.sync_dir / f".round-{rnd:04d}.tmp"
        save_file({k: v.detach().contiguous().cpu() for k, v in kept.items()}, str(tmp))
        os.replace(tmp, self.sync_dir / f"round-{rnd:04d}.safetensors")

    def prune_aggregates(self, synced: dict[int, int]) -> None:
        """Delete kept aggregates that every node had applied by ``synced`` (the beliefs of a checkpoint that
        a newer one has since replaced, so no resume can need them again)."""
        if not self.sync_needed or len(synced) < self.loop.recipe.federation.num_clients:
            return
        done = min(synced.values())
        for path in self.sync_dir.glob("round-*.safetensors"):
            if int(path.stem.split("-")[1]) <= done:
                path.unlink()

    def catch_up(self, cid: int, upto: int) -> tuple[dict[str, ArrayRecord], int]:
        """Records of the aggregates client ``cid`` has not applied, rounds ``synced+1 .. upto``."""
        from safetensors.torch import load_file

        if not self.sync_needed:
            return {}, 0
        out = {}
        for rnd in range(self.synced.get(cid, 0) + 1, upto + 1):
            out[f"sync.{rnd}"] = records.encode(load_file(str(self.sync_dir / f"round-{rnd:04d}.safetensors")),
                                                self.comm)
        return out, sum(records.record_bytes(r) for r in out.values())

    def header(self, cid: int, rnd: int, **extra: Any) -> ConfigRecord:
        if getattr(self, "recipe_yaml", None) is None:
            self.recipe_yaml = recipe_for_nodes(self.loop.recipe)  # the same text as the query's: one build per run
        return ConfigRecord({"recipe": self.recipe_yaml, "token": self.token, "round": rnd,
                             "client_id": cid, "synced_from": self.synced.get(cid, 0),
                             "step_from": self.steps.get(cid, 0), **extra})

    # ----- Flower's strategy interface
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """One message per sampled client: its plan and the aggregates it missed.

        ``config`` may name the ``sampled`` client ids and the ``lr``; by default they are the recipe's (the
        seeded sample and the learning-rate schedule of round ``server_round``), so Flower's own
        ``Strategy.start`` loop can drive this strategy too.
        """
        from fedllm.engine import client_faults
        from fedllm.engine.server import round_lr, sample_clients

        recipe = self.loop.recipe
        sampled = config["sampled"] if "sampled" in config else sample_clients(
            self.strategy.sampling_seed(recipe.seed), server_round, recipe.federation.num_clients,
            recipe.sampled_per_round())
        lr = float(config["lr"]) if "lr" in config else round_lr(recipe, server_round)
        messages = []
        self.bytes_down, self.expected, self.sent, self.received = {}, {}, {}, {}
        for cid in sampled:
            plan = self.strategy.configure_client(server_round, cid, self.loop.global_state)
            plan.lr = lr
            self.expected[cid] = client_faults.expected_upload(self.strategy, plan, self.loop.model)
            tensors, rest = records.split_extra(plan.extra)
            down = self.strategy.download_bytes(plan, self.comm)
            packed_json = "{}"
            if self.loop.downlink.enabled:  # global tensors travel compressed (fedllm.engine.compressed_rounds)
                self.loop.downlink.prepare(server_round, self.loop.global_state)
                plain = records.record_bytes(records.encode(plan.state, self.comm))
                plan.state, _, packed = self.loop.downlink.plan_state(plan.state, self.loop.global_state)
                packed_record, packed_json = records.encode_packed(packed)
                content = RecordDict({"plan": records.encode({k: v for k, v in plan.state.items() if k not in packed},
                                                             self.comm), "plan.packed": packed_record})
                down += records.record_bytes(content["plan"]) + records.record_bytes(packed_record) - plain
            else:
                content = RecordDict({"plan": records.encode(plan.state, self.comm)})
            self.received[cid] = cast(plan.state, self.comm)  # what the client holds: its upload's reference
            if tensors:
                content["extra"] = records.encode(tensors)  # as in simulation: extras are not cast
            if plan.local:
                content["local"] = records.encode(plan.local)
            sync, sync_bytes = self.catch_up(cid, server_round - 1)
            for name, record in sync.items():
                content[name] = record
            content["fedllm"] = self.header(cid, server_round, lr=plan.lr, phases=phases_json(plan.phases),
                                            extra=rest, packed=packed_json)
            self.bytes_down[cid] = down + sync_bytes
            messages.append(Message(content, dst_node_id=self.nodes[cid], message_type="train"))
            self.sent[self.nodes[cid]] = cid
        return messages

    def configure_sync(self, upto: int, clients: Iterable[int]) -> list[Message]:
        """``train.sync`` messages bringing ``clients`` to round ``upto`` (no training)."""
        messages = []
        self.bytes_down, self.sent = {}, {}
        for cid in clients:
            sync, size = self.catch_up(cid, upto)
            if not sync:
                continue
            content = RecordDict(sync)
            content["fedllm"] = self.header(cid, upto + 1)
            self.bytes_down[cid] = size
            messages.append(Message(content, dst_node_id=self.nodes[cid], message_type="train.sync"))
            self.sent[self.nodes[cid]] = cid
        return messages

    def decode_updates(self, server_round: int,
                       replies: Iterable[Message]) -> tuple[list[ClientUpdate], dict[int, str]]:
        """The clients' uploads (ordered by client id) and ``{client: why it was dropped}``.

        A node that failed, did not answer, or sent a malformed or non-finite update is dropped, as a
        client that raises is in simulation (``federation.on_client_error``); notes how far each node is synced.
        """
        from fedllm.engine import client_faults

        updates, dropped, seen = [], {}, {}
        for m in replies:
            cid = self.sent.get(m.metadata.src_node_id, self.sent.get(self.origin.get(m.metadata.reply_to_message_id)))
            if cid is None:  # not a node this round's messages went to: ignored (its client counts as silent)
                log.warning("round %d: a reply from node %s, which no message went to, ignored", server_round,
                            m.metadata.src_node_id)
                continue
            if m.has_error():
                dropped[cid] = f"failed on its node: {m.error.reason}"
                continue
            metrics = m.content.metric_records["metrics"]
            self.synced[cid] = int(metrics["synced"])
            self.steps[cid] = int(metrics.get("step", server_round))
            arrays = m.content.array_records
            try:
                state, wire = records.decode(arrays["update"]), None
                packed = (records.decode_packed(arrays["update.packed"], str(m.content.config_records["fedllm"]
                                                                             ["packed"]))
                          if "update.packed" in arrays else None)
            except records.RecordError as e:  # e.g. a node of another fedllm version: dropped, saying why
                dropped[cid] = f"its upload cannot be read: {e}"
                continue
            if packed is not None:  # a compressed upload: its change from what the client received
                from fedllm.models.compression import read_packed

                state = read_packed(packed, state, self.received.get(cid, {}), like=self.received.get(cid))
                wire = records.record_bytes(arrays["update"]) + records.record_bytes(arrays["update.packed"])
            update = ClientUpdate(cid, state, int(metrics["num_examples"]),
                                  float(metrics["loss"]) if "loss" in metrics else None, int(metrics["steps"]),
                                  wire_bytes=wire,
                                  work={k[5:]: metrics[k] for k in metrics.keys() if k.startswith("work.")})
            seen[cid] = update.steps  # trained and received, whether it is aggregated or dropped below
            problem = client_faults.update_problem(update, self.expected.get(cid))
            if problem is not None:
                dropped[cid] = problem
            else:
                updates.append(update)
        for cid in self.expected:
            if cid not in dropped and all(u.client_id != cid for u in updates):
                dropped[cid] = NO_REPLY
        self.strategy.uploads_seen(server_round, {c: s for c, s in sorted(seen.items()) if s})
        return sorted(updates, key=lambda u: u.client_id), dropped

    def note_synced(self, replies: Iterable[Message]) -> None:
        """Note how far the nodes that answered a ``train.sync`` are synced (a failed node catches up later)."""
        for m in replies:
            if m.has_error():
                log.warning("node %s did not sync: %s", m.metadata.src_node_id, m.error.reason)
                continue
            metrics = m.content.metric_records["metrics"]
            cid = self.sent.get(m.metadata.src_node_id, int(metrics["client_id"]))
            self.synced[cid] = int(metrics["synced"])
            self.steps[cid] = int(metrics.get("step", metrics["synced"]))

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round loop's aggregation of the replies; the new global adapter and the mean train loss."""
        updates, _ = self.decode_updates(server_round, replies)
        self.keep_aggregate(server_round, self.loop.aggregate(server_round, updates))
        from fedllm.engine.server import released_mean_loss

        loss = released_mean_loss(updates)
        return records.encode(self.loop.global_state), MetricRecord({} if loss is None else {"train_loss": loss})

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """None: evaluation runs on the server (the recipe's ``eval``), as in simulation."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log.info("fedllm strategy %s over Flower (%d clients)", self.strategy.name,
                 self.loop.recipe.federation.num_clients)


def recipe_for_nodes(recipe: Any) -> str:
    """The recipe the nodes build their federation from (YAML), with the run's CPU thread count: the recipe's
    ``train.threads``, else this ServerApp's (:mod:`fedllm.common.threads`: what ``fedllm train`` of the recipe uses on
    this machine). The count fixes a run's floating-point results (a matrix product sums in another order on another
    count, and bf16 training carries the difference on), so every node trains with it and the run equals the
    one-process run bit for bit (a node's ``FEDLLM_THREADS`` still wins: faster, equal up to summation order)."""
    import dataclasses

    from fedllm.common import threads
    from fedllm.recipe.schema import dump_recipe

    chosen = threads.chosen()
    if recipe.train.threads is None and chosen is not None:
        recipe = dataclasses.replace(recipe, train=dataclasses.replace(recipe.train, threads=chosen.threads))
    return dump_recipe(recipe)
