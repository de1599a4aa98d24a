"""Flower rounds across an emulated internet, against the ideal round (issue 50, item 2).

One loopback deployment (an insecure SuperLink, one ``fedllm flower supernode`` per client with its worker), each
SuperNode connected to the SuperLink through its own :class:`fedllm.flower.wan_proxy.WanProxy`. The proxies' links
are switched between runs, so every profile runs on the same processes, interleaved (loopback, profile 1, 2, 3,
loopback, ...), plain FedAvg and SecAgg+ alternating:

- ``loopback``: the proxies forward without delay (the compute baseline: training, aggregation and Flower's local
  costs, proxies included);
- ``region``: 20 ms round trip, 1 Gbit/s each way;
- ``continent``: 80 ms, 100 Mbit/s;
- ``intercontinental``: 200 ms, 20 Mbit/s, and client 0 (one slow site) at 5 Mbit/s each way.

The payload is the quickstart's model, SmolLM2-135M-Instruct, with LoRA on q/k/v/o (240 tensors, 460 800 fp32 bytes
per unit of rank): ``--payload quickstart`` is the quickstart's r 8 (3 686 400 B each way per client),
``--payload 7b`` r 146 (67 276 800 B, the 7B recipe's 67 MB). One local step of batch 2 per client (the compute is
the loopback baseline's; what is measured is what the network adds). Every client trains in every round, so the
slow site is in every round.

A round's ideal = the slowest client's ``training + bytes down / bandwidth down + bytes up / bandwidth up`` + round
trips x RTT, with 1 round trip for a plain round (the train message and its reply) and 4 for SecAgg+ (its keys, check
and unmask stages add 3). The training is measured in the same round: the node workers log each train message
(``received in A s, answered in B s, handed back in C s``), and B is the training, so the load of a shared machine,
which moves the training time from round to round, cancels out of the ratio; the local work of the deployment
(the ServerApp, the SuperLink, the SuperNodes: serialising, hashing and moving the bytes over loopback HTTP) is not
in the ideal, and the ``loopback`` profile shows what it costs.

Prints, per profile and mode, medians over rounds >= 2: the round, the ideal, their ratio, and the slowest client's
training (B), its bytes / bandwidth, its message received in (A: the download, the SuperNode's poll and pulls), handed
back in (C: to its SuperNode), the rest of the round; what went through the proxies (Fleet API requests by path per
client and run, wire bytes per client and round); then the round hop by hop for the client whose reply reached the
SuperLink last, from every request timed at its proxy (:mod:`fedllm.flower.request_log`): its download (the poll that
returned the message to its confirmation), its node (the worker's training and hand-back, the SuperNode's reply
poll), its upload (``push-messages`` to the last object's answer), each against its bytes / bandwidth, and the
server side (the rest: the ServerApp's push into the SuperLink, the collect, the aggregation); and the CPU seconds of
each kind of process per run. ``--report-from DIR`` prints the report of a run kept with ``--keep DIR`` again.

    python bench/wan_rounds.py --payload quickstart --trials 2 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import statistics
import sys
import tempfile
import threading
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedllm.flower.request_log import RequestLog, transfers  # noqa: E402 (after the path)
from fedllm.flower.wan_proxy import DOWN, UP, Link, WanProxy, running  # noqa: E402

PAYLOAD_RANK = {"quickstart": 8, "7b": 146}  # SmolLM2-135M, q/k/v/o of 30 layers: 460 800 fp32 bytes per unit of r
RTT_MS = {"loopback": 0, "region": 20, "continent": 80, "intercontinental": 200}
MBIT = {"loopback": None, "region": 1000, "continent": 100, "intercontinental": 20}
SLOW_SITE = {"intercontinental": (0, 5)}  # profile -> (client, Mbit/s)
ROUND_TRIPS = {False: 1, True: 4}
REQUEST = re.compile(rb"(?:POST|GET|PUT) (/[A-Za-z0-9_/\-]+)")


def links(profile: str, client: int) -> tuple[Link, Link]:
    """``(up, down)`` of ``client`` in ``profile``."""
    mbit = MBIT[profile]
    slow = SLOW_SITE.get(profile)
    if slow is not None and slow[0] == client:
        mbit = slow[1]
    one_way = RTT_MS[profile] / 2
    return Link(one_way, mbit), Link(one_way, mbit)


def recipe(args: argparse.Namespace, data: Path, out: Path, secure: bool) -> dict:
    rank = PAYLOAD_RANK[args.payload]
    raw = {
        "seed": 0, "output_dir": str(out), "model": {"name": "smollm2-135m-instruct"},
        "lora": {"r": rank, "alpha": 2 * rank, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(data), "format": "instruction", "fields": {"instruction": "question", "output": "answer"}},
        "federation": {"num_clients": args.clients, "clients_per_round": args.clients, "rounds": args.rounds,
                       "strategy": "fedavg", "partition": {"method": "iid"}},
        "train": {"local_steps": 1, "batch_size": 2, "lr": 1e-3, "max_length": 64, "dtype": "fp32", "threads": 1},
        "eval": {"tasks": []}, "checkpoint": {"every": 0}, "logging": {"progress": False, "quiet": True},
    }
    if secure:
        raw["privacy"] = {"secure_aggregation": "secagg_plus", "secagg": {"max_dropouts": 1, "neighbours": 3}}
    return raw


class Tap:
    """Counts the Fleet API requests and bytes through one client's proxy (thread-safe; read between runs)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.bytes = {UP: 0, DOWN: 0}

    def __call__(self, connection: int, direction: str, data: bytes) -> None:
        with self.lock:
            self.bytes[direction] += len(data)
            if direction == UP:
                self.requests.update(m.decode().rsplit("/", 1)[-1] for m in REQUEST.findall(data))

    def take(self) -> tuple[Counter, dict[str, int]]:
        with self.lock:
            out = (self.requests, dict(self.bytes))
            self.requests, self.bytes = Counter(), {UP: 0, DOWN: 0}
            return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--payload", choices=sorted(PAYLOAD_RANK), default="quickstart")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=1, help="passes over every profile (interleaved)")
    ap.add_argument("--profiles", default="loopback,region,continent,intercontinental")
    ap.add_argument("--modes", default="plain,secagg")
    ap.add_argument("--keep", help="keep the runs and logs in this new directory")
    ap.add_argument("--report-from", help="print the report of a run kept with --keep (same other arguments)")
    args = ap.parse_args()
    if args.report_from:
        with open(Path(args.report_from) / "seen.pickle", "rb") as f:
            order, outs, seen, *cpu = pickle.load(f)
        outs = [Path(args.report_from) / out.name for out in outs]  # the directory may have moved
        return report(args, order, outs, seen, Path(args.report_from), *cpu)

    from scaling import flower_run

    from tests.conftest import arith_records, write_jsonl

    profiles = args.profiles.split(",")
    modes = [m == "secagg" for m in args.modes.split(",")]
    order = [(p, s) for _ in range(args.trials) for p in profiles for s in modes]
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="fedllm-wan-"))
    work.mkdir(parents=True, exist_ok=bool(not args.keep))
    data = write_jsonl(work / "arith.jsonl", arith_records(96))
    path = work / "recipe.yaml"
    taps = [Tap() for _ in range(args.clients)]
    logs = [RequestLog() for _ in range(args.clients)]  # every request timed, for the per-hop split
    proxies: list[WanProxy] = []
    seen: list[tuple] = []  # per run: (requests by path, wire bytes, timed requests), each per client

    def take() -> tuple:
        return (*zip(*[t.take() for t in taps], strict=True), [log.take() for log in logs])

    import yaml

    def write(i: int) -> None:
        profile, secure = order[i]
        if i:
            seen.append(take())
        for cid, proxy in enumerate(proxies):
            up, down = links(profile, cid)
            proxy.links = {UP: up, DOWN: down}
        path.write_text(yaml.safe_dump(recipe(args, data, work / f"unused-{i}", secure)))

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with ExitStack() as stack:
        def node_superlink(cid: int, port: int) -> str:
            def observe(connection: int, direction: str, data: bytes) -> None:
                taps[cid](connection, direction, data)
                logs[cid](connection, direction, data)

            proxy = stack.enter_context(running(WanProxy(("127.0.0.1", port), observer=observe)))
            logs[cid].proxy = proxy
            proxies.append(proxy)
            return f"127.0.0.1:{proxy.address[1]}"

        write(0)
        cpu: list[dict[str, float]] = []
        outs = flower_run(path, [], args.clients, work, env, 3600, repeats=len(order), between=write,
                          node_superlink=node_superlink, cpu_kinds=cpu)
        seen.append(take())
    with open(work / "seen.pickle", "wb") as f:  # the timed requests: --report-from reads them again
        pickle.dump((order, outs, seen, cpu), f)
    report(args, order, outs, seen, work, cpu)


WORKER_LINE = re.compile(r"train message: received in ([0-9.]+) s, answered in ([0-9.]+) s, handed back in ([0-9.]+) s")


def worker_lines(work: Path, clients: int) -> list[list[tuple[float, float, float]]]:
    """Per client, its worker's ``(received, answered, handed back)`` seconds of every train message, in order."""
    return [[tuple(map(float, m)) for m in WORKER_LINE.findall((work / f"supernode{c}.log").read_text())]
            for c in range(clients)]


def report(args, order, outs, seen, work: Path, cpu: list[dict[str, float]] | None = None) -> None:
    """One line per profile and mode: the median round against the ideal built from the same rounds' compute."""
    lines = worker_lines(work, args.clients)
    rows: dict[tuple[str, bool], list[dict]] = {}
    hops: dict[tuple[str, bool], list[dict]] = {}
    for i, ((profile, secure), out, (requests, wire, timed)) in enumerate(zip(order, outs, seen, strict=True)):
        history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        moved = [train_transfers(t, args.rounds) for t in timed]
        for h in history:
            if h.get("round", 0) < 2:
                continue
            at = i * args.rounds + h["round"] - 1
            msg = {c: lines[c][at] for c in range(args.clients)}
            hop = round_hops(h, msg, moved, profile, args.clients)
            if hop is not None:
                hops.setdefault((profile, secure), []).append(hop)
            transfer = {c: client_bytes(h, "down", c) / (links(profile, c)[1].bytes_per_s or float("inf"))
                        + client_bytes(h, "up", c) / (links(profile, c)[0].bytes_per_s or float("inf"))
                        for c in range(args.clients)}
            slowest = max(range(args.clients), key=lambda c: msg[c][1] + transfer[c])
            ideal = msg[slowest][1] + transfer[slowest] + ROUND_TRIPS[secure] * RTT_MS[profile] / 1e3
            rows.setdefault((profile, secure), []).append({
                "seconds": h["seconds"], "ideal": ideal, "received": msg[slowest][0], "answered": msg[slowest][1],
                "handed": msg[slowest][2], "transfer": transfer[slowest], "up": client_bytes(h, "up", slowest),
                "requests": requests, "wire": wire})
    print(f"payload {args.payload} (r {PAYLOAD_RANK[args.payload]}), {args.clients} clients, all per round, "
          f"{args.rounds} rounds, {args.trials} trial(s); rounds >= 2, medians; the slowest client's messages")
    print(f"{'profile':17s} {'mode':6s} {'round':>6s} {'ideal':>6s} {'ratio':>6s} {'train':>6s} {'bytes/bw':>8s} "
          f"{'recv':>6s} {'handbk':>6s} {'rest':>6s}  requests per client and run; wire MB up/down per client-round")
    for (profile, secure), runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "ideal", "answered", "transfer",
                                                                   "received", "handed")}
        ratio = statistics.median(r["seconds"] / r["ideal"] for r in runs)
        rest = statistics.median(r["seconds"] - r["answered"] - r["received"] - r["handed"] for r in runs)
        requests, n_runs = Counter(), 0
        wire = {UP: 0, DOWN: 0}
        for reqs, w in {id(r["requests"]): (r["requests"], r["wire"]) for r in runs}.values():
            n_runs += 1
            for node in reqs:
                requests.update(node)
            for node in w:
                wire[UP], wire[DOWN] = wire[UP] + node[UP], wire[DOWN] + node[DOWN]
        per = n_runs * args.clients
        text = ", ".join(f"{k} {v / per:.0f}" for k, v in requests.most_common(6))
        mb = [wire[d] / per / args.rounds / 1e6 for d in (UP, DOWN)]
        print(f"{profile:17s} {'secagg' if secure else 'plain':6s} {med['seconds']:6.2f} {med['ideal']:6.2f} "
              f"{ratio:6.2f} {med['answered']:6.2f} {med['transfer']:8.2f} {med['received']:6.2f} {med['handed']:6.2f} "
              f"{rest:6.2f}  {text}; {mb[0]:.2f}/{mb[1]:.2f} (payload {runs[0]['up'] / 1e6:.2f})")
    print_hops(hops)
    if cpu:
        print_cpu(order, outs, cpu)


def client_bytes(h: dict, direction: str, client: int) -> float:
    """A client's bytes ``direction`` ("up"/"down") in round record ``h``; under SecAgg+ the record keeps totals only
    (``privacy.per_client_stats``), and every client here moves the same payload: the total over the clients."""
    per_client = h.get(f"bytes_{direction}")
    if per_client is not None:
        return per_client[str(client)]
    return h[f"bytes_{direction}_total"] / len(h["clients"])


def train_transfers(requests: list, rounds: int) -> tuple[list, list]:
    """One client's train messages received and replies sent in one run, round by round: the first ``rounds``
    replies among those that pushed the most objects (a train reply carries the model; the discovery query's and
    SecAgg+'s stages' replies push fewer), each with the message received last before it. (A received message's
    object requests count retries of objects not yet at the SuperLink, so they do not tell which message it was.)"""
    moved = transfers(requests)
    most = max((t.objects for t in moved if t.kind == "send"), default=0)
    received, sent = [], []
    for i, t in enumerate(moved):
        if t.kind == "send" and t.objects >= max(1, most // 2) and len(sent) < rounds:
            before = [r for r in moved[:i] if r.kind == "receive"]
            if before:
                received.append(before[-1])
                sent.append(t)
    return received, sent


def round_hops(h: dict, msg: dict, moved: list, profile: str, clients: int) -> dict | None:
    """Where the round went, hop by hop, for the client whose reply reached the SuperLink last: the SuperLink ->
    SuperNode download (its poll that returned the message to its confirmation), the node's local hop (confirmation
    to the reply's ``push-messages``: the worker's pull from its SuperNode, its training and hand-back, the
    SuperNode's reply poll; ``worker``: its training + hand-back, as it logged them),
    the SuperNode -> SuperLink upload (``push-messages`` to the last object's answer), and the server side (the rest
    of the round: the ServerApp's push to the SuperLink, the node's wait for its poll, the collect, the
    aggregation); each against its ideal."""
    at = h["round"] - 1
    if any(len(moved[c][0]) <= at or len(moved[c][1]) <= at for c in range(clients)):
        return None
    last = max(range(clients), key=lambda c: moved[c][1][at].end)
    down, up = moved[last][0][at], moved[last][1][at]
    up_link, down_link = links(profile, last)
    return {"client": last, "down": down.seconds, "down_rt": down.round_trips, "down_objects": down.objects,
            "down_ideal": client_bytes(h, "down", last) / (down_link.bytes_per_s or float("inf")),
            "node": up.start - down.end, "worker": msg[last][1] + msg[last][2], "train": msg[last][1],
            "up": up.seconds, "up_rt": up.round_trips, "up_objects": up.objects,
            "up_ideal": client_bytes(h, "up", last) / (up_link.bytes_per_s or float("inf")),
            "server": h["seconds"] - (up.end - down.start)}


def print_hops(hops: dict) -> None:
    """Per profile and mode, medians over rounds >= 2 of :func:`round_hops`."""
    print("\nper hop, the client whose reply reached the SuperLink last (medians, s; serial round trips and objects "
          "of its train message and reply):")
    print(f"{'profile':17s} {'mode':6s} {'down':>7s} {'ideal':>7s} {'rt/obj':>6s} {'node':>6s} {'worker':>6s} "
          f"{'train':>6s} {'up':>7s} {'ideal':>7s} {'rt/obj':>6s} {'server':>6s}")
    for (profile, secure), runs in hops.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"{profile:17s} {'secagg' if secure else 'plain':6s} {med['down']:7.2f} {med['down_ideal']:7.2f} "
              f"{med['down_rt']:3.0f}/{med['down_objects']:<2.0f} {med['node']:6.2f} {med['worker']:6.2f} "
              f"{med['train']:6.2f} {med['up']:7.2f} {med['up_ideal']:7.2f} "
              f"{med['up_rt']:3.0f}/{med['up_objects']:<2.0f} {med['server']:6.2f}")


def print_cpu(order, outs, cpu: list[dict[str, float]]) -> None:
    """Per run (query, rounds, final sync), the CPU seconds of each kind of process, and the clients' training
    (the rounds' ``train_cpu_seconds``, inside the workers' figure): the local work a round costs apart from the
    links, which a loaded machine stretches in wall time but not in CPU time."""
    print("\nCPU seconds per run, by process (the clients' training is part of the workers'):")
    for (profile, secure), out, spent in zip(order, outs, cpu, strict=True):
        history = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
        train = sum((h.get("throughput") or {}).get("train_cpu_seconds") or 0.0 for h in history)
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in sorted(spent.items(), key=lambda kv: -kv[1]))
        print(f"{profile:17s} {'secagg' if secure else 'plain':6s} {kinds}; training {train:.1f}")

if __name__ == "__main__":
    main()
