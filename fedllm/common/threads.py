"""CPU threading, chosen before torch is imported.

OpenMP's worker threads busy-wait between parallel regions. On an idle machine that
saves a wake-up; on a machine where one other process runs, the spinning workers
fight it for the cores and a round gets 3-15x slower (measured in
``bench/cpu_threads.py``, table in the README). fedllm therefore sets, before torch
loads, unless the user already did:

- the thread count: the cores this process may use (``os.sched_getaffinity``)
  divided by the local processes of a multi-process launch (``LOCAL_WORLD_SIZE``);
- the wait policy from what the machine is doing at start-up: when other processes
  keep the usable cores busy (sampled from ``/proc/stat`` over :data:`SAMPLE_SECONDS`),
  ``OMP_WAIT_POLICY=PASSIVE`` (idle workers sleep at once instead of spinning and
  fighting the other process); on an idle machine, OpenMP's default (spinning keeps
  the idle speed). A fixed short spin (``GOMP_SPINCOUNT``) was measured too and still
  collapses under contention (README, Results).

Precedence of the thread count: ``FEDLLM_THREADS`` > ``train.threads`` > a
user-set ``OMP_NUM_THREADS`` > automatic. The spin setting is left alone when any of
``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``KMP_BLOCKTIME`` is set. The choice is
logged at debug level and written to ``summary.json`` (:func:`in_effect`).

Only the standard library is imported here.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, MutableMapping, Optional

#: Environment variable that overrides the thread count (beats ``train.threads``).
ENV_THREADS = "FEDLLM_THREADS"
#: Variables that carry a thread count to the libraries that keep a pool.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS")
#: Variables that set how idle OpenMP workers wait; if any is set, fedllm sets none.
WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
#: Wait setting used when the machine is busy at start-up (see the README's table).
BUSY_WAIT = {"OMP_WAIT_POLICY": "PASSIVE"}
#: Fraction of the usable cores that other processes must keep busy for the machine to count as busy.
BUSY_FRACTION = 0.25
#: How long start-up samples the CPU counters.
SAMPLE_SECONDS = 0.05

log = logging.getLogger("fedllm.common.threads")
_chosen: Optional["ThreadPolicy"] = None
_set_by_us: dict[str, str] = {}


@dataclass
class ThreadPolicy:
    """What fedllm chose for this process, and why."""

    threads: int
    source: str  # "FEDLLM_THREADS" | "train.threads" | "OMP_NUM_THREADS" | "auto"
    wait: dict[str, str]  # the wait/spin variables in effect (set by fedllm or by the user)
    wait_source: str  # "user" | "fedllm (busy)" | "fedllm (idle: OpenMP default)"
    cores: int
    local_processes: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def local_processes(env: MutableMapping[str, str]) -> int:
    """Processes of a multi-process launch on this machine (torchrun / accelerate set ``LOCAL_WORLD_SIZE``)."""
    for var in ("LOCAL_WORLD_SIZE", "ACCELERATE_NUM_PROCESSES"):
        value = env.get(var, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def busy_fraction(seconds: float = SAMPLE_SECONDS) -> float:
    """Fraction of all cores busy over ``seconds`` (``/proc/stat``; 0.0 where it cannot be read)."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        return sum(fields), fields[3] + fields[4]  # all, idle + iowait (jiffies)

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, 1.0 - (idle1 - idle0) / max(1, total1 - total0))


def _positive(value: str, name: str) -> int:
    from fedllm.common.errors import InputError

    if not value.strip().isdigit() or int(value) <= 0:
        raise InputError(f"environment variable {name}={value!r}: expected a positive integer (CPU threads)")
    return int(value)


def choose(env: MutableMapping[str, str], train_threads: Optional[int] = None) -> ThreadPolicy:
    """The policy for ``env`` (not applied): thread count by precedence, wait setting unless the user set one."""
    cores, procs = usable_cores(), local_processes(env)
    if env.get(ENV_THREADS):
        threads, source = _positive(env[ENV_THREADS], ENV_THREADS), ENV_THREADS
    elif train_threads is not None:
        threads, source = int(train_threads), "train.threads"
    elif env.get("OMP_NUM_THREADS"):
        threads, source = _positive(env["OMP_NUM_THREADS"], "OMP_NUM_THREADS"), "OMP_NUM_THREADS"
    else:
        threads, source = max(1, cores // procs), "auto"
    user_wait = {v: env[v] for v in WAIT_VARS if env.get(v)}
    if user_wait:
        return ThreadPolicy(threads, source, user_wait, "user", cores, procs)
    busy = busy_fraction() >= BUSY_FRACTION if "torch" not in sys.modules else False
    return ThreadPolicy(threads, source, dict(BUSY_WAIT) if busy else {}, "fedllm (busy)" if busy else
                        "fedllm (idle: OpenMP default)", cores, procs)


def apply(train_threads: Optional[int] = None, env: Optional[MutableMapping[str, str]] = None) -> ThreadPolicy:
    """Choose and apply the policy: environment variables (before torch loads), ``torch.set_num_threads`` after.

    Safe to call more than once (the CLI calls it before torch loads, ``server.run`` again
    with the recipe's ``train.threads``): only variables that fedllm set itself are
    replaced; a variable the user set is never changed (a thread count that overrides it
    reaches torch through ``torch.set_num_threads``). Once torch is loaded the wait
    setting can no longer change, so an earlier choice of it is kept.
    """
    global _chosen
    env = os.environ if env is None else env
    torch_loaded = "torch" in sys.modules
    if torch_loaded and _chosen is not None:
        for var in THREAD_VARS:  # our own earlier count must not read as the user's
            if var in _set_by_us and env.get(var) == _set_by_us.pop(var):
                env.pop(var)
        policy = choose(env, train_threads)
        policy.wait, policy.wait_source = _chosen.wait, _chosen.wait_source
    else:
        for var, value in list(_set_by_us.items()):
            if env.get(var) == value:
                env.pop(var)
        _set_by_us.clear()
        policy = choose(env, train_threads)
    wanted = {var: str(policy.threads) for var in THREAD_VARS}
    if policy.wait_source.startswith("fedllm") and not torch_loaded:
        wanted.update(policy.wait)
    for var, value in wanted.items():
        if var not in env:
            env[var] = _set_by_us[var] = value
    if torch_loaded:  # the pool exists already: only the count can still change
        sys.modules["torch"].set_num_threads(policy.threads)
    _chosen = policy
    log.debug("CPU threads: %d (%s; %d usable cores / %d local processes); OpenMP wait: %s (%s)",
              policy.threads, policy.source, policy.cores, policy.local_processes,
              " ".join(f"{k}={v}" for k, v in policy.wait.items()) or "default", policy.wait_source)
    return policy


def chosen() -> Optional[ThreadPolicy]:
    """The policy applied in this process, or None when :func:`apply` was never called."""
    return _chosen


def in_effect() -> dict[str, Any]:
    """What the run actually used (for ``summary.json``): the policy plus torch's own thread count."""
    out: dict[str, Any] = _chosen.as_dict() if _chosen else {"source": "not set by fedllm"}
    if "torch" in sys.modules:
        out["torch_threads"] = sys.modules["torch"].get_num_threads()
    out["wait_env"] = {v: os.environ[v] for v in WAIT_VARS if v in os.environ}
    return out
