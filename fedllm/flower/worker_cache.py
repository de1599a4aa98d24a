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
    """The worker's built nodes, keyed by run token, node config and recipe (the newest ``size`` kept)."""

    def __init__(self, size: int = 2):
        self.size = size
        self.nodes: OrderedDict[tuple, tuple[Any, dict[str, Any]]] = OrderedDict()
        self.built = 0  # how many federations this worker has built (a test checks it stays at one per run)

    @contextmanager
    def serving(self):
        """Make this cache the one :func:`open_node` uses (the worker's ClientApp calls)."""
        global _ACTIVE
        _ACTIVE = self
        try:
            yield self
        finally:
            _ACTIVE = None

    def get(self, config: Any, recipe_yaml: str, token: str) -> Any:
        """The run's node, as a freshly built one would be."""
        from fedllm.flower.node import Node

        key = (token, config.client_id, str(config.state_dir), config.data_path, recipe_yaml)
        if key in self.nodes:
            node, initial = self.nodes.pop(key)
            _reset(node, initial)
        else:
            node = Node(config, recipe_yaml, token)
            initial = _snapshot(node)
            self.built += 1
            logging.getLogger("fedllm").info("fedllm worker: built the federation of run %s for client %d", token,
                                             config.client_id)
        self.nodes[key] = (node, initial)
        while len(self.nodes) > self.size:
            self.nodes.popitem(last=False)
        return node


def open_node(config: Any, recipe_yaml: str, token: str) -> Any:
    """A node for one message: from the worker's cache inside the worker, else freshly built."""
    from fedllm.flower.node import Node

    return _ACTIVE.get(config, recipe_yaml, token) if _ACTIVE is not None else Node(config, recipe_yaml, token)
