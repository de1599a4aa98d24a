"""A test-only stop point for the Flower deployment tests' node processes (never on a user's path).

tests/flower_cluster.py puts this folder first on the SuperNodes' ``PYTHONPATH`` and names a folder in
``FEDLLM_TESTS_STOP_AT``; without that variable this module does nothing. With it, every process of the node
(its node worker among them) wraps :func:`fedllm.flower.client_app._open_node` once that module is imported: a
node about to open the round ``R`` train message of client ``C`` looks for the file ``stop-client-C-round-R`` in that
folder. If it is there (the test armed it), the process claims it (renames it, so exactly one message stops), writes its
pid into ``stop-client-C-round-R.reached`` and stops itself with ``SIGSTOP``: the message has been received and, in
fedllm's node worker, journaled (:func:`fedllm.flower.runtime.run_client_task` journals before it answers), and
no reply has been sent. The test waits for that file (an event, not a guessed number of seconds) and then kills
the stopped process with ``kill -9``.
"""

import os

STOP_AT = os.environ.get("FEDLLM_TESTS_STOP_AT")
TARGET = "fedllm.flower.client_app"


def stop_if_armed(cfg, context) -> None:
    """Stop this process (SIGSTOP) if the test armed the stop for this message's client and round."""
    import signal
    from pathlib import Path

    from fedllm.flower.node import NodeConfig

    client = NodeConfig.parse(dict(context.node_config)).client_id
    armed = Path(STOP_AT, f"stop-client-{client}-round-{int(cfg['round'])}")
    claimed = armed.with_name(armed.name + ".claimed")
    try:
        os.rename(armed, claimed)  # atomic: one message (one process) claims the stop
    except FileNotFoundError:
        return
    claimed.write_text(str(os.getpid()))
    os.rename(claimed, armed.with_name(armed.name + ".reached"))  # the event: the file appears with the pid in it
    os.kill(os.getpid(), signal.SIGSTOP)


def patch(module) -> None:
    opened = module._open_node

    def _open_node(msg, context):
        stop_if_armed(msg.content.config_records["fedllm"], context)
        return opened(msg, context)

    module._open_node = _open_node


def install() -> None:
    """Patch :data:`TARGET` right after it is first imported (a meta path finder wrapping its loader)."""
    import importlib.abc
    import importlib.util
    import sys

    class PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != TARGET:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, PatchOnImport())


def run_shadowed() -> None:
    """Run the ``sitecustomize`` this module shadows on ``sys.path`` (a distribution's Python may have one), as Python
    would have run it."""
    import importlib.machinery
    import importlib.util
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.machinery.PathFinder.find_spec(
        "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != here])
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


run_shadowed()
if STOP_AT:
    install()
