"""How long a SuperLink or SuperNode keeps a silent task alive: 3 minutes in fedllm's deployment, not Flower's 60 s.

Flower 1.42 ends a running task (the ServerApp's on the SuperLink, a ClientApp's on its SuperNode) whose token has
not been renewed by a heartbeat for ``HEARTBEAT_PATIENCE × HEARTBEAT_DEFAULT_INTERVAL`` = 2 × 30 s
(``flwr/supercore/corestate/{in_memory,sql}_corestate.py``: ``activate_task``, ``acknowledge_task_heartbeat``): the
run is then "finished:failed: No heartbeat received from the task", or the worker's answer is refused. A heartbeat
is sent every ~20 s with a 5 s call timeout, so two late ones lose the run. On a 2-core machine at load 15-80 with
the out-of-memory killer at work, that happened: README's test command failed a real deployment that way (and the
nodes' workers then found their tasks gone). fedllm's SuperLink and SuperNode entries therefore read
:data:`PATIENCE` heartbeats; the heartbeats themselves, and the node-online timing of the Fleet API (its own
constant, in ``flwr/server/superlink/linkstate``), are Flower's. A task that really died (its process killed) is
ended that much later: fedllm's ServerApp runner and node workers notice their children's deaths themselves.
"""

from __future__ import annotations

import importlib

PATIENCE = 6
"""Heartbeats of 30 s a running task may miss before Flower ends it (Flower: 2)."""
MODULES = ("flwr.supercore.corestate.in_memory_corestate", "flwr.supercore.corestate.sql_corestate")
"""Flower's task stores, each of which imported ``HEARTBEAT_PATIENCE`` by name."""


def tolerate_stalls(patience: int = PATIENCE) -> None:
    """Make this process's Flower task stores keep a running task for ``patience`` heartbeat intervals.

    Raises:
        RuntimeError: a store no longer reads ``HEARTBEAT_PATIENCE`` (another Flower version): nothing is patched
            silently."""
    for name in MODULES:
        module = importlib.import_module(name)
        if not hasattr(module, "HEARTBEAT_PATIENCE"):
            raise RuntimeError(f"{name} has no HEARTBEAT_PATIENCE (Flower {_flower_version()}): fedllm's task "
                               "patience was written for flwr 1.42")
        module.HEARTBEAT_PATIENCE = patience


def _flower_version() -> str:
    from importlib.metadata import version

    return version("flwr")
