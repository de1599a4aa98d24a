"""fedllm's SuperNode pulls a message's objects all at once (fedllm/flower/object_concurrency.py): Flower's
``pull_objects`` runs 20 requests at a time even where the core count would cap it (a 1-core machine here), while
``push_object_contents_from_iterable`` keeps Flower's 2 (uploads share the uplink under Flower's 30 s request timeout),
not capped to the core count's 1; a count the user set is kept, and a bad one exits 2 naming it. Each case runs in a
fresh interpreter: Flower reads its concurrency when it is first imported."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Each object request blocks until `expected` requests are in flight together (then all go on): the pool must hold
# that many at once, or the wait times out. Reported: the most in flight at once and the threads that served them.
PROBE = r"""
import json, os, sys, threading
os.cpu_count = lambda: 1  # a 1-core machine: Flower's own get_num_workers would allow 1 request at a time
from fedllm.flower.object_concurrency import lift
lift()
from flwr.supercore.inflatable import inflatable_utils

def probe(expected, run):
    lock, all_in = threading.Condition(), threading.Event()
    state = {"active": 0, "peak": 0, "threads": set()}
    def request(*_):
        with lock:
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
            state["threads"].add(threading.get_ident())
            if state["active"] >= expected:
                all_in.set()
        reached = all_in.wait(timeout=60)
        with lock:
            state["active"] -= 1
        if not reached:
            raise TimeoutError(f"never {expected} requests at once (peak {state['peak']})")
        return b"x"
    run(request)
    return {"peak": state["peak"], "threads": len(state["threads"])}

objects = [f"{i:064x}" for i in range(int(sys.argv[1]))]
pulls = probe(int(sys.argv[2]), lambda fn: inflatable_utils.pull_objects(objects, fn))
pushes = probe(int(sys.argv[3]), lambda fn: inflatable_utils.push_object_contents_from_iterable(
    ((o, b"x") for o in objects), fn))
print(json.dumps({"pulls": pulls, "pushes": pushes}))
"""


def _probe(objects: int, pulls: int, pushes: int, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_PRIVATE_MAX_CONCURRENT_OBJ_")}
    return subprocess.run([sys.executable, "-c", PROBE, str(objects), str(pulls), str(pushes)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env})


def test_a_message_s_objects_are_pulled_20_at_a_time_and_pushed_2_whatever_the_core_count():
    done = _probe(24, 20, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    # 24 objects: pulled 20 at once by 20 threads, pushed 2 at once (Flower's default on 1 core: min(2, 1) = 1 each)
    assert json.loads(done.stdout) == {"pulls": {"peak": 20, "threads": 20}, "pushes": {"peak": 2, "threads": 2}}


def test_a_count_the_user_set_is_kept():
    done = _probe(6, 3, 6, FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS="3", FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES="6")
    assert done.returncode == 0, done.stderr[-3000:]
    # the user's 3 pulls and 6 pushes at once (not the core cap's 1, nor fedllm's 20 and 2)
    assert json.loads(done.stdout) == {"pulls": {"peak": 3, "threads": 3}, "pushes": {"peak": 6, "threads": 6}}


def test_a_bad_count_exits_2_naming_the_variable_its_value_and_what_is_expected():
    done = _probe(2, 1, 1, FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES="0")
    assert done.returncode == 2, done.stderr[-3000:]
    assert "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES='0': expected a whole number >= 1" in done.stderr


def test_lifting_after_flower_is_imported_is_refused():
    done = subprocess.run([sys.executable, "-c", "import flwr.supercore.constant\n"
                           "from fedllm.flower.object_concurrency import lift\nlift()"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ,
                                                                                     "PYTHONPATH": str(ROOT)})
    assert done.returncode == 1 and "must run before Flower is imported" in done.stderr, done.stderr[-3000:]
