"""A SuperNode's round trips per message over an emulated WAN: Flower's 2 objects at a time against fedllm's all at
once (issue 50, item 2; :mod:`fedllm.flower.object_concurrency`).

One deployment (``tests/flower_wan/wan_cluster.py``: an insecure SuperLink, 2 ``fedllm flower supernode`` with their
workers, each behind its own :class:`fedllm.flower.wan_proxy.WanProxy` timing every request with a
:class:`fedllm.flower.request_log.RequestLog`). Client 0 is *before*: its SuperNode and worker run with
``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS=2`` and ``_PUSHES=2``, Flower's defaults, which fedllm keeps when a user sets
them (Flower also caps them at the core count: on any machine of 2 cores or more that is the same 2). Client 1 is
*after*: fedllm's default, 20. Both train in every round, so each round gives one message of each, side by side; runs
alternate the links' round trip (``--rtts``, e.g. 200, 80, 200, 80, ...). The payload is small (the tests' tiny LLaMA,
LoRA r 4: a few kB an object) and the bandwidth unlimited, so the serial round trips do not depend on the machine's
load; the seconds do, by each request's local handling (on a loaded 2-core machine 0.1-1.6 s a message beyond its
round trips). The proxies charge TCP's handshake to a new connection.

Prints, per round trip time and node, medians over every train message (a run's first message, the discovery query,
which also fetches the run and its app, left out): messages, objects per message, serial round trips to receive a
message (the ``pull-messages`` that returns it, its objects, its confirmation) and to send its reply
(``push-messages``, its objects), the object requests' own serial round trips, and the seconds, also in RTTs; every
request's timing goes to ``requests.json`` in the work directory.

    python bench/wan_objects.py --trials 3 --rounds 3 --rtts 200,80
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fedllm.flower.request_log import RequestLog, transfers  # noqa: E402 (the repository first on the path)
from fedllm.flower.wan_proxy import DOWN, UP, Link  # noqa: E402
from tests.conftest import arith_records, tiny_raw, write_jsonl  # noqa: E402
from tests.flower_wan.wan_cluster import wan_deployment  # noqa: E402

BEFORE = {"FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS": "2", "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PUSHES": "2"}
NODES = {0: "before (2 at a time)", 1: "after (fedllm: 20)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2, help="runs per round trip time (interleaved)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rtts", default="200,80", help="round trip times in ms, one run each per trial")
    ap.add_argument("--keep", help="keep the deployment's logs and runs in this new directory")
    args = ap.parse_args()
    rtts = [float(x) for x in args.rtts.split(",")]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fedllm-wan-objects-"))
    work.mkdir(parents=True, exist_ok=not args.keep)
    data = write_jsonl(work / "arith.jsonl", arith_records(48))
    logs = {cid: RequestLog() for cid in NODES}
    seen: dict[tuple[float, int], list] = {}
    with wan_deployment(work, len(NODES), observers=logs, node_env={0: BEFORE}) as (port, proxies, _, launch):
        for cid, proxy in enumerate(proxies):
            logs[cid].proxy = proxy
        for i, rtt in enumerate(rtt for _ in range(args.trials) for rtt in rtts):
            for proxy in proxies:
                proxy.links = {UP: Link(rtt / 2), DOWN: Link(rtt / 2)}
            for log in logs.values():
                log.take()  # the idle polls before this run
            raw = tiny_raw(work / f"run-{i}", data, federation={"num_clients": len(NODES),
                                                                 "clients_per_round": len(NODES),
                                                                 "rounds": args.rounds})
            (work / f"recipe-{i}.yaml").write_text(yaml.safe_dump(raw))
            run = launch(["flower", "run", str(work / f"recipe-{i}.yaml"), "--superlink", f"127.0.0.1:{port}",
                          "--insecure", "--timeout", "600"], work / f"run-{i}.log")
            if run.wait(timeout=900) != 0:
                raise SystemExit(f"run {i} failed: {(work / f'run-{i}.log').read_text()[-3000:]}")
            for cid, log in logs.items():
                seen.setdefault((rtt, cid), []).append(log.take())
    report(args, rtts, seen, work)


def report(args, rtts: list[float], seen: dict, work: Path) -> None:
    """One line per round trip time and node: medians over the train messages (each run's first message, the
    discovery query, which also fetches the run and its app, left out)."""
    (work / "requests.json").write_text(json.dumps(
        {f"{rtt:g} ms, client {cid}": [[asdict(r) for r in run] for run in runs] for (rtt, cid), runs in seen.items()}))
    print(f"{args.trials} trial(s) x {args.rounds} rounds per RTT, 2 nodes side by side; medians over the train "
          f"messages (requests: {work / 'requests.json'})")
    print(f"{'RTT ms':>6s}  {'node':20s} {'msgs':>4s} {'objects':>7s}  {'serial RTTs: in + out = all (objects)':>37s}"
          f"  {'seconds: in + out = all':>23s}  {'all/RTT':>7s}")
    for rtt in rtts:
        for cid, name in NODES.items():
            moved = [t for run in seen[(rtt, cid)] for t in transfers(run)[2:]]
            ins, outs = [t for t in moved if t.kind == "receive"], [t for t in moved if t.kind == "send"]
            if not ins or not outs:
                print(f"{rtt:6.0f}  {name:20s} no complete message")
                continue

            def med(ts, key):
                return statistics.median(getattr(t, key) for t in ts)

            trips = [med(ins, "round_trips"), med(outs, "round_trips")]
            seconds = [med(ins, "seconds"), med(outs, "seconds")]
            print(f"{rtt:6.0f}  {name:20s} {len(ins):4d} {med(ins, 'objects'):3.0f}/{med(outs, 'objects'):<3.0f}  "
                  f"{trips[0]:17.0f} + {trips[1]:.0f} = {sum(trips):.0f} ({med(ins, 'object_round_trips'):.0f} + "
                  f"{med(outs, 'object_round_trips'):.0f})  {seconds[0]:9.2f} + {seconds[1]:.2f} = "
                  f"{sum(seconds):.2f}  {sum(seconds) / (rtt / 1e3):7.1f}")


if __name__ == "__main__":
    main()
