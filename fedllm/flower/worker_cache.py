"""The node worker's memory: each run's :class:`fedllm.flower.node.Node`, built once and reused per message.

A fresh :class:`Node` (what Flower's per-message ClientApp process builds) is the recipe's federation as
``build_federation`` makes it, then the client's saved state loaded from ``--state-dir``. The worker builds
it once, remembers that freshly built state (the LoRA factors, the strategy's state and, for strategies
that change it, the LoRA-wrapped base weights) and, for every later message, puts it back before loading
the saved state, so each message starts from exactly what a fresh process would have: the results equal
the per-message ClientApp's, and the simulation's.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any

_ACTIVE: NodeCache | None = None


def _snapshot(node: Any) -> dict[str, Any]:
    import copy

    from fedllm.engine.server import base_weights
    from fedllm.models.loading import read_state

    model, strategy = node.fed.loaded.model, node.fed.strategy
    keys = [n for n, p in model.named_parameters() if p.requires_grad or "lora_" in n]
    return {"params": read_state(model, keys), "strategy": copy.deepcopy(strategy.state_dict()),
            "base": base_weights(model) if strategy.modifies_base else {},
            "requires_grad": {n: p.requires_grad for n, p in model.named_parameters()}}


def _reset(node: Any, initial: dict[str, Any]) -> None:
    import copy

    from fedllm.models.loading import write_state
    from fedllm.runs.client_store import ClientStore

    model = node.fed.loaded.model
    write_state(model, initial["base"])
    write_state(model, initial["params"])
    for name, param in model.named_parameters():
        param.requires_grad_(initial["requires_grad"][name])
    node.fed.strategy.load_state_dict(copy.deepcopy(initial["strategy"]))
    node.store, node.synced = ClientStore(), 0


class NodeCache:
    """The worker's built nodes, keyed by run token, node config and recipe (the newest ``size`` kept).

    A run's node is built ahead of its first message: the server's query announces the run (:meth:`prepare`), and
    the worker builds the node right after handing back the query's reply (:meth:`build_prepared`), in its one
    thread, between messages (a build seeds torch's global random generator: it must not run beside a message
    that trains).
    """

    def __init__(self, size: int = 2):
        self.size = size
        self.nodes: OrderedDict[tuple, tuple[Any, dict[str, Any]]] = OrderedDict()
        self.built = 0  # how many federations this worker has built (a test checks it stays at one per run)
        self.prepared: dict[tuple, tuple[Any, str, str]] = {}  # announced runs, not built yet

    @staticmethod
    def key(config: Any, recipe_yaml: str, token: str) -> tuple:
        return (token, config.client_id, str(config.state_dir), config.data_path, recipe_yaml)

    @contextmanager
    def serving(self):
        """Make this cache the one :func:`open_node` uses (the worker's ClientApp calls)."""
        global _ACTIVE
        _ACTIVE = self
        try:
            yield self
        finally:
            _ACTIVE = None

    def _build(self, key: tuple, config: Any, recipe_yaml: str, token: str, ahead: bool) -> Any:
        from fedllm.flower.node import Node
        from fedllm.models import kept_bases

        copies = kept_bases.hits
        node = Node(config, recipe_yaml, token)
        self.nodes[key] = (node, _snapshot(node))
        self.built += 1
        logging.getLogger("fedllm").info("fedllm worker: built the federation of run %s for client %d%s%s", token,
                                         config.client_id, " (ahead of its first message)" if ahead else "",
                                         ", the base copied from memory" if kept_bases.hits > copies else "")
        while len(self.nodes) > self.size:
            self.nodes.popitem(last=False)
        return node

    def prepare(self, config: Any, recipe_yaml: str, token: str) -> None:
        """Note that the run's node is wanted soon (built by :meth:`build_prepared`, unless built already)."""
        key = self.key(config, recipe_yaml, token)
        if key not in self.nodes:
            self.prepared[key] = (config, recipe_yaml, token)

    def build_prepared(self) -> None:
        """Build the nodes of the runs announced since the last call while there is room: a run announced but not
        yet training never pushes out the warm node of another run (its first message builds it then). A failure
        is logged; the run's first message builds again and reports it."""
        while self.prepared:
            key, (config, recipe_yaml, token) = self.prepared.popitem()
            if key in self.nodes or len(self.nodes) >= self.size:
                continue
            try:
                self._build(key, config, recipe_yaml, token, ahead=True)
            except Exception as e:  # noqa: BLE001 — told to the server by the message that needs the node
                logging.getLogger("fedllm").warning("fedllm worker: could not build the federation of run %s ahead "
                                                    "of its first message: %s", token, e)

    def get(self, config: Any, recipe_yaml: str, token: str) -> Any:
        """The run's node, as a freshly built one would be."""
        key = self.key(config, recipe_yaml, token)
        self.prepared.pop(key, None)
        if key not in self.nodes:
            return self._build(key, config, recipe_yaml, token, ahead=False)
        node, initial = self.nodes.pop(key)
        _reset(node, initial)
        self.nodes[key] = (node, initial)
        return node


def prepare_node(config: Any, recipe_yaml: str, token: str) -> None:
    """Inside a node worker, start building the run's node ahead of its first message (else nothing)."""
    if _ACTIVE is not None:
        _ACTIVE.prepare(config, recipe_yaml, token)


def open_node(config: Any, recipe_yaml: str, token: str) -> Any:
    """A node for one message: from the worker's cache inside the worker, else freshly built."""
    from fedllm.flower.node import Node

    return _ACTIVE.get(config, recipe_yaml, token) if _ACTIVE is not None else Node(config, recipe_yaml, token)
