"""Flower's SuperNode as ``fedllm flower supernode`` runs it: objects pulled without Flower's 1 s backoff.

A SuperNode learns of a message before all of its objects (5 MiB chunks of its tensors) have reached the
SuperLink, and Flower pulls an object that is not there yet again after 1 s, then 2, 4 and up to 10 s
(``flwr.supercore.constant.PULL_INITIAL_BACKOFF`` and ``PULL_BACKOFF_CAP``, defaults of ``pull_objects``, no option
and no environment variable): a message of a few chunks waits seconds for bytes that arrive in milliseconds.
``python -m fedllm.flower.supernode ARGS`` runs ``flower-supernode ARGS`` with the SuperNode's pulls asking again
after 50 ms, doubling up to 0.5 s (:func:`quick_object_pulls`); nothing else of Flower changes.
"""

from __future__ import annotations

import sys
from types import ModuleType

INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 0.5


def quick_object_pulls(module: ModuleType) -> None:
    """Make ``module``'s ``pull_objects`` (Flower's, imported there by name) retry after :data:`INITIAL_BACKOFF_S`,
    doubling up to :data:`BACKOFF_CAP_S`, instead of Flower's 1 s up to 10 s."""
    import functools

    from flwr.supercore.inflatable import inflatable_utils

    module.pull_objects = functools.partial(inflatable_utils.pull_objects, initial_backoff=INITIAL_BACKOFF_S,
                                            backoff_cap=BACKOFF_CAP_S)


def main(argv: list[str] | None = None) -> None:
    """``flower-supernode`` with :func:`quick_object_pulls` (``argv``: its arguments)."""
    from flwr.supernode import start_client_internal
    from flwr.supernode.cli import flower_supernode

    quick_object_pulls(start_client_internal)
    sys.argv = ["flower-supernode", *(sys.argv[1:] if argv is None else argv)]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
