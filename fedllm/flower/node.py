"""A SuperNode's side of a federation: its client's data, its per-client state, its replica of the shared model.

Flower starts a fresh ClientApp process for every message, so everything a client keeps between
rounds lives in its state directory (``--node-config "state-dir='...'"``), one folder per run:
``<state-dir>/<run token>/client-<k>/step-<NNNN>/`` is a fedllm checkpoint (written atomically) of the
client after round NNNN (the last few are kept, so a server that resumes from an older checkpoint finds
the state the client had then), holding

- ``clients.safetensors``: this client's per-client state (SCAFFOLD's ``c_i``, private factors, optimizer
  moments: :class:`fedllm.runs.client_store.ClientStore`), which never leaves the node;
- ``base.safetensors`` / ``strategy.safetensors``: the node's replica of what every client changes (FRLoRA's,
  FedLoRU's, FedEx-LoRA's and FLoRA's merges into the base), and the round it is synced to; the base as a
  snapshot hard-linked from the previous step plus a log of low-rank merges (:mod:`fedllm.runs.base_history`), so a
  step writes adapter-sized bytes.

Catch-up (FRLoRA's non-participant sync, DESIGN.md §4): the server keeps each round's aggregate and sends
a client the rounds it missed with its next message (and every client the rest after the last round);
the node replays :meth:`Strategy.after_aggregate` on them, the very code the server runs, so its base
is the server's ``Ŵ^t``. A strategy that changes the base inside ``aggregate`` (FedEx-LoRA, FLoRA: no node
runs it) sends instead the round's logged low-rank merges (:mod:`fedllm.runs.base_history`), which the node
replays with the server's exact arithmetic. Either way a catch-up carries factors, never a dense matrix.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedllm.common.errors import InputError

NODE_KEYS = ("partition-id", "state-dir", "data-path")


@dataclass
class NodeConfig:
    """What ``--node-config`` tells a SuperNode."""

    client_id: int
    state_dir: Path
    data_path: str | None = None

    @classmethod
    def parse(cls, node_config: dict[str, Any]) -> NodeConfig:
        """Read ``partition-id`` (the client id, 0-based), ``state-dir`` and optional ``data-path``."""
        if "partition-id" not in node_config:
            raise InputError("--node-config: key 'partition-id' missing; expected the client id, e.g. "
                             "--node-config \"partition-id=0 state-dir='/var/fedllm'\"")
        cid = node_config["partition-id"]
        if not isinstance(cid, int) or isinstance(cid, bool) or cid < 0:
            raise InputError(f"--node-config: partition-id={cid!r}; expected an integer >= 0")
        state_dir = node_config.get("state-dir") or str(Path.home() / ".fedllm" / "flower-state")
        data_path = node_config.get("data-path") or None
        return cls(cid, Path(str(state_dir)).expanduser(), str(data_path) if data_path else None)


DOWNLOAD_PREFIX = "download/"
"""Catch-up entries holding a round's compressed download (codes and absmax per key)."""


def replays_after_aggregate(strategy: Any) -> bool:
    """True when every client must apply ``after_aggregate`` too (it changes more than the global state)."""
    from fedllm.strategies.base import Strategy

    return type(strategy).after_aggregate is not Strategy.after_aggregate


def needs_sync(strategy: Any) -> bool:
    """True when every client must replay each round: ``after_aggregate``, or merges made in ``aggregate``."""
    return replays_after_aggregate(strategy) or bool(getattr(strategy, "merges_in_aggregate", False))


class Node:
    """One client's federation on its SuperNode, rebuilt from the recipe the server sends."""

    def __init__(self, config: NodeConfig, recipe_yaml: str, token: str):
        from fedllm.engine.server import build_federation
        from fedllm.recipe.checks import parse_recipe
        from fedllm.recipe.schema import read_written_yaml

        self.config = config
        overrides = []
        if config.data_path:  # the node's own data: all of it is this client's
            overrides = [f"data.path={config.data_path}", "federation.num_clients=1", "federation.clients_per_round=1",
                         "federation.fraction=null", "federation.min_clients_per_round=1",
                         "federation.partition.method=iid"]
        recipe = parse_recipe(read_written_yaml(recipe_yaml), "<recipe from the server>", overrides)
        self.recipe = recipe
        self.use_threads()
        self.fed = build_federation(recipe)
        self.indices = self.fed.data.clients[0 if config.data_path else config.client_id]
        self.dir = config.state_dir / token / f"client-{config.client_id}"
        self.synced = 0

    def use_threads(self) -> None:
        """Train with the run's CPU thread count (``train.threads``: the recipe's, else the ServerApp's, which it
        writes into the recipe it sends: :func:`fedllm.flower.adapter.recipe_for_nodes`), set again for each message
        (a worker serves several runs); this machine's ``FEDLLM_THREADS`` wins, said once."""
        import os

        from fedllm.common import threads

        run_threads = self.recipe.train.threads
        if run_threads is None:
            return
        mine = os.environ.get(threads.ENV_THREADS, "").strip()
        wanted = int(mine) if mine.isdigit() and int(mine) > 0 else run_threads
        torch = sys.modules.get("torch")
        if torch is None or torch.get_num_threads() != wanted or threads.chosen() is None:
            policy = threads.apply(run_threads)
            if policy.threads != run_threads and not getattr(self, "_told", False):
                self._told = True
                logging.getLogger("fedllm").warning(
                    "CPU threads %d (%s on this node), the run's %d: this client's results equal the one-process run's "
                    "up to floating-point summation order, not bit for bit", policy.threads, policy.source, run_threads)

    def steps(self) -> list[Path]:
        """Saved states of this client, oldest first."""
        from fedllm.runs import checkpoint as ckpt_io

        return sorted(p for p in self.dir.glob("step-*") if ckpt_io.is_checkpoint(p))

    def load(self, before: int, expected_step: int = 0) -> None:
        """Restore this client's state and the replica as they were after its newest step before round ``before`` that
        the server knows of (``expected_step``).

        ``expected_step``: the newest step the server knows this node saved (0: none); a node that has lost
        it (state directory deleted or replaced) fails loudly instead of training from a blank state.
        """
        from fedllm.runs import checkpoint as ckpt_io
        from fedllm.runs.client_store import ClientStore

        self.store = ClientStore()
        # the newest step the server accepted: a step saved after a reply it never took (late for its round's
        # deadline, federation.round_deadline) or after its resumed checkpoint is not this client's state
        found = [p for p in self.steps() if int(p.name.split("-")[1]) < before
                 and int(p.name.split("-")[1]) <= expected_step]
        newest = int(found[-1].name.split("-")[1]) if found else 0
        if newest < expected_step:
            raise RuntimeError(f"client {self.config.client_id}: state lost: the server expects its state after "
                               f"round {expected_step} in {self.dir}, found {'step ' + str(newest) if found else 'none'}"
                               " (state directory deleted or replaced?)")
        if found:
            ck = ckpt_io.load_checkpoint(found[-1])
            ckpt_io.restore_into(self.fed.loaded.model, self.fed.strategy, ck)
            self.store = ckpt_io.client_store(ck)
            self.synced = ck.round
        else:  # the model as training starts, before any catch-up: DPO's reference log-probabilities, once
            self.prepare()

    def prepare(self) -> None:
        """What this client computes once from the starting model (:mod:`fedllm.engine.reference`)."""
        from functools import partial

        from fedllm.data.collate import collate
        from fedllm.engine.reference import precompute_references

        fed = self.fed
        precompute_references(fed.loaded.model, self.store, fed.data.examples, {self.config.client_id: self.indices},
                              self.recipe.train, partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id,
                                                         task=fed.loaded.task))

    def save(self, step: int, adapter: dict) -> None:
        """Write this client's state and the replica after round ``step`` atomically; prune old steps."""
        import shutil

        from fedllm.engine.server import base_fields
        from fedllm.recipe.schema import dump_recipe
        from fedllm.runs import checkpoint as ckpt_io
        from fedllm.strategies.client_ranks import RankedClients

        strategy = self.fed.strategy
        if isinstance(strategy, RankedClients):  # a rank-r_k plan (FLoRA, FlexLoRA): kept in the model's shapes
            adapter = strategy.pad(adapter)
        ckpt_io.save_checkpoint(self.dir / f"step-{step:04d}", ckpt_io.Checkpoint(
            round=self.synced, adapter=adapter, strategy=strategy.state_dict(), clients=self.store.flat(),
            **base_fields(self.fed.loaded.model, strategy),
            meta={"client_id": self.config.client_id, "strategy": self.recipe.federation.strategy},
            recipe_yaml=dump_recipe(self.recipe)))
        keep = max(2, (self.recipe.checkpoint.every or 0) + 1)  # a resumed server may go back that far
        for old in self.steps()[:-keep]:
            shutil.rmtree(old)

    def catch_up(self, synced_from: int, rounds: dict[int, dict]) -> None:
        """Apply the rounds this node missed: the server's logged merges (``merge/...`` entries), then
        ``after_aggregate`` on the aggregate, as on the server."""
        from fedllm.models.loading import write_state
        from fedllm.runs.base_history import merges_from_state

        if not rounds:
            return
        if self.synced != synced_from:
            raise RuntimeError(f"client {self.config.client_id}: its state in {self.dir} is at round {self.synced}, "
                               f"the server expected round {synced_from} (state directory lost or replaced?)")
        strategy = self.fed.strategy
        for rnd in sorted(rounds):
            merges = merges_from_state(rounds[rnd])
            if merges:
                strategy.base.apply(rnd, merges)
            if replays_after_aggregate(strategy):
                aggregate = {k: v for k, v in rounds[rnd].items() if not k.startswith(("merge/", DOWNLOAD_PREFIX))}
                strategy.downloaded = self.round_download(rounds[rnd], aggregate)
                try:
                    write_state(self.fed.loaded.model, strategy.after_aggregate(rnd, self.fed.loaded.model, aggregate))
                finally:
                    strategy.downloaded = None
            self.synced = rnd

    def round_download(self, entries: dict, aggregate: dict) -> dict | None:
        """The round's dequantised download from its codes and absmax in a catch-up entry (``download/<key>/...``,
        federation.compression.download; what the server's ``after_aggregate`` read), or None when it has none."""
        from fedllm.models.compression import Packed, unpack

        keys = [k[len(DOWNLOAD_PREFIX):-len("/codes")] for k in entries if k.startswith(DOWNLOAD_PREFIX)
                and k.endswith("/codes")]
        if not keys:
            return None
        c = self.recipe.federation.compression
        return {k: unpack(Packed(entries[f"{DOWNLOAD_PREFIX}{k}/codes"], entries[f"{DOWNLOAD_PREFIX}{k}/absmax"],
                                 tuple(aggregate[k].shape), c.download, c.block_size)).to(aggregate[k].dtype)
                for k in keys}

    def train(self, rnd: int, lr: float, state: dict, phases: list, extra: dict, local: dict) -> Any:
        """Train this client for round ``rnd`` through :func:`fedllm.engine.client.run_client` (as in simulation)."""
        from functools import partial

        from fedllm.data.collate import collate
        from fedllm.engine.client import run_client
        from fedllm.recipe.schedule import derived_seed
        from fedllm.strategies.base import ClientPlan, Phase

        fed = self.fed
        plan = ClientPlan(client_id=self.config.client_id, rnd=rnd, state=state,
                          phases=[Phase(**p) for p in phases], extra=extra, lr=lr, local=local)
        collate_fn = partial(collate, pad_id=fed.loaded.tokenizer.pad_token_id, task=fed.loaded.task)
        return run_client(fed.loaded.model, plan, fed.strategy, self.store, fed.data.examples, self.indices,
                          self.recipe.train, collate_fn, derived_seed(self.recipe.seed, rnd, plan.client_id))


def phases_json(phases: list) -> str:
    """A plan's phases as JSON (``Phase`` fields)."""
    return json.dumps([{"keys": p.keys, "steps": p.steps, "name": p.name} for p in phases])
