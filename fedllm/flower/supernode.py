"""Flower's SuperNode as ``fedllm flower supernode`` runs it: without Flower's fixed waits between messages.

``python -m fedllm.flower.supernode ARGS`` runs ``flower-supernode ARGS`` (Flower 1.42, unchanged on disk) with
four of its waits shortened, each inside the SuperNode process only:

- **object pulls** (:func:`quick_object_pulls`): a SuperNode learns of a message before all of its objects (5 MiB
  chunks of its tensors) have reached the SuperLink, and Flower pulls an object that is not there yet again after
  1 s, then 2, 4 and up to 10 s (``flwr.supercore.constant.PULL_INITIAL_BACKOFF`` and ``PULL_BACKOFF_CAP``, defaults
  of ``pull_objects``): here after 50 ms, doubling up to 0.5 s.
- **the idle poll** (:class:`QuickWaits`): when the SuperLink has no message for it, Flower's SuperNode asks again
  after a fixed 3 s (``flwr/supernode/start_client_internal.py``, ``start_client_internal``, line 263:
  ``time.sleep(3)``), so every message waited 1.5 s on average before a node saw it. Here it asks again after
  :data:`IDLE_FIRST_S`, doubling up to :data:`RUN_CAP_S` for :data:`RUN_WINDOW_S` after a message (the other
  messages of a round are on their way) and up to :data:`IDLE_CAP_S` after that, and quickly again after each message.
- **reconnecting** (:func:`quick_reconnects`): a SuperNode that cannot reach its SuperLink (restarting, or not
  ready yet) asks again after a random wait below 1 s, 2, 4, 8, 16, then 20 s (``flwr.common.constant.MAX_RETRY_DELAY``,
  Flower's full jitter), so a node saw a restarted SuperLink up to 20 s after it was back (9.3 s in a trial at load 6
  on 2 cores); here below :data:`RECONNECT_FIRST_S`, doubling up to :data:`RECONNECT_CAP_S`.
- **the reply wait** (:class:`QuickWaits`): while its ClientApp (fedllm's worker) answers, the SuperNode looks for
  the reply every 0.5 s (``_push_messages``, lines 470 and 506: ``time.sleep(0.5)``), a look in its own memory:
  here every :data:`REPLY_POLL_S`.

Neither wait is an option or an environment variable of Flower's: the module's ``time`` is replaced by
:class:`QuickWaits`, which passes every other use through. And once a message is stored (its task created), the
SuperNode wakes its node worker (:mod:`fedllm.flower.wake`) instead of letting it poll. Its worker's task stays
alive through 3 minutes without a heartbeat, not 60 s (:mod:`fedllm.flower.task_patience`). A message's objects
are pulled all at once, not 2 at a time; its reply's are pushed at Flower's 2 (:mod:`fedllm.flower.object_concurrency`).
Its Runtime API hands each request's body to Flower's middleware in one message (:mod:`fedllm.flower.whole_body`).
"""

from __future__ import annotations

import sys
import time
from types import ModuleType

from fedllm.flower.task_patience import tolerate_stalls

INITIAL_BACKOFF_S = 0.05
BACKOFF_CAP_S = 0.5

FLOWER_IDLE_POLL_S = 3
"""Flower's fixed wait after a pull that found no message (``start_client_internal.py:263``)."""
FLOWER_REPLY_POLL_S = 0.5
"""Flower's fixed wait between looks for the ClientApp's reply (``start_client_internal.py:470, 506``)."""
IDLE_FIRST_S = 0.02
"""The first wait after a pull that found nothing: right after a message the next one of a round often follows
within a fraction of a second (a SecAgg+ stage: the server collects the node's reply, then sends the next stage), so
the SuperNode asks after 20, 40, 80, 160 ms, then every :data:`RUN_CAP_S` until :data:`RUN_WINDOW_S` have passed,
then backs off to :data:`IDLE_CAP_S` (before: 100 ms, 200, 400, then 500: a message a few hundred ms after the last
one waited up to 400 ms before its node saw it)."""
IDLE_CAP_S = 0.5
"""The longest wait between idle pulls: a message waits 0.25 s on average before its node sees it (Flower: 1.5 s),
for two small requests a second per idle node instead of one every 3 s."""
RUN_CAP_S = 0.2
"""The longest wait between pulls within :data:`RUN_WINDOW_S` of a message: a node that answered waits there for
the next stage of its round, which comes when the slowest sampled node has answered (SecAgg+'s unmasking after the
training, the next round's keys after the aggregation), seconds later on a real model; it sees it 0.1 s later on
average instead of 0.25 s."""
RUN_WINDOW_S = 10.0
"""How long after a message the SuperNode keeps asking at least every :data:`RUN_CAP_S`."""
REPLY_POLL_S = 0.02
"""Between looks for the reply: a look in the SuperNode's memory, no request."""
RECONNECT_FIRST_S = 0.25
"""The first wait before a SuperNode asks an unreachable SuperLink again (Flower: 1 s)."""
RECONNECT_CAP_S = 2.0
"""The longest wait between reconnection attempts (Flower: 20 s): a node sees a SuperLink that is back within 2 s, 1 s
on average (Flower's jitter draws each wait between 0 and this), for at most one failed connection a second while it
is away."""


def quick_object_pulls(module: ModuleType) -> None:
    """Make ``module``'s ``pull_objects`` (Flower's, imported there by name) retry after :data:`INITIAL_BACKOFF_S`,
    doubling up to :data:`BACKOFF_CAP_S`, instead of Flower's 1 s up to 10 s."""
    import functools

    from flwr.supercore.inflatable import inflatable_utils

    module.pull_objects = functools.partial(inflatable_utils.pull_objects, initial_backoff=INITIAL_BACKOFF_S,
                                            backoff_cap=BACKOFF_CAP_S)


def quick_reconnects(module: ModuleType) -> None:
    """Make the retry invoker ``module`` (``flwr.supernode.fleet_http_connection``) builds for its Fleet API calls
    wait from :data:`RECONNECT_FIRST_S` up to :data:`RECONNECT_CAP_S` (jittered as Flower jitters), not 1 s up to
    20 s; everything else of it (what it retries, when it gives up) stays Flower's."""
    from flwr.supercore.retry import retry_invoker

    flowers = module.make_simple_http_retry_invoker

    def make_simple_http_retry_invoker():
        invoker = flowers()
        invoker.wait_gen_factory = lambda: retry_invoker.exponential(RECONNECT_FIRST_S, 2, RECONNECT_CAP_S)
        return invoker

    module.make_simple_http_retry_invoker = make_simple_http_retry_invoker


class QuickWaits:
    """The ``time`` module as Flower's ``start_client_internal`` sees it: its 3 s idle wait and 0.5 s reply waits
    shortened (module docstring); any other sleep and every other attribute are :mod:`time`'s own."""

    def __init__(self, clock=None) -> None:
        from fedllm.flower.backoff import Backoff

        self.idle = Backoff(IDLE_FIRST_S, IDLE_CAP_S, sleep=lambda s: time.sleep(s))  # looked up at each call
        self.clock = clock or (lambda: time.monotonic())
        self.last_message = -float("inf")

    def __getattr__(self, name: str):
        return getattr(time, name)

    @property
    def idle_s(self) -> float:
        """The next idle wait."""
        return self.idle.next_s

    def sleep(self, seconds: float) -> None:
        if seconds == FLOWER_IDLE_POLL_S:
            in_run = self.clock() - self.last_message < RUN_WINDOW_S
            self.idle.cap = RUN_CAP_S if in_run else IDLE_CAP_S
            self.idle.wait()
        elif seconds == FLOWER_REPLY_POLL_S:
            time.sleep(REPLY_POLL_S)
        else:
            time.sleep(seconds)

    def message_came(self) -> None:
        """A message arrived: the next idle pulls start quick again and stay at most :data:`RUN_CAP_S` apart for
        :data:`RUN_WINDOW_S`."""
        self.idle.reset()
        self.last_message = self.clock()


def worker_secret(argv: list[str]) -> bytes | None:
    """The node worker's secret (``--superexec-auth-secret-file``'s content), None without a worker."""
    from pathlib import Path

    for i, arg in enumerate(argv):
        path = arg.split("=", 1)[1] if arg.startswith("--superexec-auth-secret-file=") else (
            argv[i + 1] if arg == "--superexec-auth-secret-file" and i + 1 < len(argv) else None)
        if path:
            try:
                return Path(path).read_bytes()
            except OSError:
                return None
    return None


def quick_supernode(module: ModuleType, secret: bytes | None) -> QuickWaits:
    """Shorten Flower's waits in ``module`` (``flwr.supernode.start_client_internal``) and wake the worker holding
    ``secret`` whenever a message has been stored."""
    from fedllm.flower import wake

    quick_object_pulls(module)
    waits = QuickWaits()
    module.time = waits
    pull_and_store = module._pull_and_store_message

    def pull_and_store_then_wake(*args, **kwargs):
        run_id = pull_and_store(*args, **kwargs)
        if run_id is not None:
            waits.message_came()
            if secret is not None:
                wake.notify(secret)
        return run_id

    module._pull_and_store_message = pull_and_store_then_wake
    return waits


def whole_bodies(module: ModuleType) -> None:
    """Make ``module``'s ``create_app`` (``flwr.supernode.main``: the SuperNode's Runtime API, which its node worker
    pushes replies to) hand each request's body to Flower's layers in one message
    (:class:`~fedllm.flower.whole_body.WholeBody`, outermost)."""
    from fedllm.flower.whole_body import WholeBody

    flowers = module.create_app

    def create_app(*args, **kwargs):
        app = flowers(*args, **kwargs)
        app.add_middleware(WholeBody)
        return app

    module.create_app = create_app


def main(argv: list[str] | None = None) -> None:
    """``flower-supernode`` with :func:`quick_supernode` and a message's objects moved at once
    (:func:`fedllm.flower.object_concurrency.lift`; ``argv``: its arguments)."""
    from fedllm.flower.object_concurrency import lift

    lift()  # before Flower's import: it reads its object concurrency then
    from flwr.supernode import fleet_http_connection, start_client_internal
    from flwr.supernode import main as supernode_app
    from flwr.supernode.cli import flower_supernode

    args = sys.argv[1:] if argv is None else argv
    quick_supernode(start_client_internal, worker_secret(args))
    whole_bodies(supernode_app)
    quick_reconnects(fleet_http_connection)
    tolerate_stalls()
    sys.argv = ["flower-supernode", *args]
    sys.exit(flower_supernode())


if __name__ == "__main__":
    main()
