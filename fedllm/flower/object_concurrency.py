"""A message's objects are pulled all at once, not 2 at a time: fewer round trips per message over a wide-area link.

Flower 1.42 sends a message as its objects (fedllm: 6 per train message, one ``Array`` per record) and moves them one
request each, at most ``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS`` / ``_PUSHES`` at a time (default 2, read when
``flwr.supercore.constant`` is imported, bound then as the default of ``pull_objects``, ``push_objects`` and
``push_object_contents_from_iterable`` in ``flwr/supercore/inflatable/inflatable_utils.py``), and no more than
``os.cpu_count()`` at a time (``get_num_workers``). A SuperNode 200 ms from its SuperLink thus paid 3 round trips to
pull a train message's 6 objects and 3 to push its reply's, where 1 each would do (``bench/wan_objects.py``).

:func:`lift`, called first by the entry point that moves objects over the network (``python -m
fedllm.flower.supernode``: the SuperNode), before it imports Flower:

- sets the pulls' variable to :data:`OBJECT_CONCURRENCY` and the pushes' to Flower's 2 (:data:`FEDLLM_DEFAULTS`: why
  not uploads) where the user has not set them (a value the user set is kept, and checked: a whole number >= 1, else
  exit 2 naming it);
- lets ``get_num_workers`` give what it is asked for: its cap at the core count was meant for CPU work, and these
  threads wait on the network (a 2-core node was held to 2 whatever the variables said).

The threads are only more requests in flight: Flower submits every object of a message to its pool at once either
way, so the memory held is the same; the bytes are the same.

The ServerApp runner and the node worker (``python -m fedllm.flower.runtime``) keep Flower's 2: they talk to their
SuperLink or SuperNode over loopback, where a round trip costs nothing, and a ServerApp that pushed the 7B payload's
four messages (52 chunks of 5 MiB) 20 at a time into a SuperLink on a loaded 2-core machine (load 14) saw requests
time out (httpx's 30 s), and Flower's retry of a chunk the SuperLink had already stored is refused ("push session may
have expired or been replaced"): the run failed (``bench/wan_rounds.py --payload 7b``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

OBJECT_CONCURRENCY = 20
"""Objects moved at once: all of a fedllm message's (6 for the quickstart's adapter; 18 for the 7B recipe's 67 MB,
13 of them 5 MiB chunks of its one ``Array``), and no more connections than Flower's HTTP client keeps alive
(httpx's default pool: 20), so that they are reused from one message to the next rather than opened again."""
VARIABLES = ("FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS", "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES")
"""Flower's variables, read once when ``flwr.supercore.constant`` is imported."""
FEDLLM_DEFAULTS = {VARIABLES[0]: OBJECT_CONCURRENCY, VARIABLES[1]: 2}
"""What :func:`lift` sets where the user has not: pulls all at once; pushes at Flower's own 2. An upload's requests
share the node's uplink, and Flower gives each request 30 s (httpx's timeout) and retries one that timed out, which
the SuperLink refuses for an object it already stored: 20 chunks of 5 MiB pushed at once over a 5 Mbit/s uplink took
the 7B payload's node 0 out of every round (``bench/wan_rounds.py --payload 7b``, intercontinental), where 2 at a
time finish each in 17 s. A pull is safe to retry, and a download's bytes keep flowing on every connection."""
DEFAULTS = (("pull_objects", "max_concurrent_pulls", VARIABLES[0]),
            ("pull_and_inflate_object_from_tree", "max_concurrent_pulls", VARIABLES[0]),
            ("push_objects", "max_concurrent_pushes", VARIABLES[1]),
            ("push_object_contents_from_iterable", "max_concurrent_pushes", VARIABLES[1]))
"""``(function of inflatable_utils, its keyword, the variable it defaults to)``: checked after :func:`lift`."""


def uncapped_workers(max_concurrent: int) -> int:
    """``get_num_workers`` without the core-count cap: the threads wait on the network, not on a core."""
    return max(1, max_concurrent)


def lift(environ: MutableMapping[str, str] | None = None) -> dict[str, int]:
    """Set Flower's object concurrency for this process (module docstring); returns what is in effect per variable.

    Must run before anything imports Flower (its constants are read once, at import).

    Raises:
        RuntimeError: Flower was imported already, or its functions no longer default to these variables (another
            Flower version): nothing is changed silently.
        SystemExit(2): a variable the user set is not a whole number >= 1.
    """
    environ = os.environ if environ is None else environ
    if "flwr.supercore.constant" in sys.modules:
        raise RuntimeError("fedllm: object_concurrency.lift() must run before Flower is imported (its constants are "
                           "read at import)")
    wanted = {}
    for name in VARIABLES:
        value = environ.setdefault(name, str(FEDLLM_DEFAULTS[name]))
        try:
            wanted[name] = int(value)
        except ValueError:
            wanted[name] = 0
        if wanted[name] < 1:
            print(f"fedllm: environment variable {name}={value!r}: expected a whole number >= 1 (objects moved at "
                  f"once; fedllm's default {OBJECT_CONCURRENCY})", file=sys.stderr, flush=True)
            sys.exit(2)
    from flwr.supercore.inflatable import inflatable_utils

    for function, keyword, name in DEFAULTS:
        default = (getattr(inflatable_utils, function).__kwdefaults__ or {}).get(keyword)
        if default != wanted[name]:
            raise RuntimeError(f"fedllm: flwr's {function}({keyword}=...) defaults to {default!r}, not {name}="
                               f"{wanted[name]}: fedllm's object concurrency was written for flwr 1.42")
    inflatable_utils.get_num_workers = uncapped_workers
    return wanted
