"""Train a round's sampled clients on Flower's grid: the round loop of :mod:`fedllm.engine.server`, unchanged,
with SuperNodes doing the client side.

The ServerApp hands a :class:`FlowerExecutor` to :func:`fedllm.engine.server.run`, so a Flower run writes the same
run directory as ``fedllm train`` (metrics.jsonl, checkpoints, final/) and resumes from its newest checkpoint
after a server restart. Before the first round it asks every connected node which client it serves
(``query.fedllm``), optionally with a transport probe (a tensor of ``probe_mb`` MB the node sums), and waits,
reporting, until one node serves each client; each client is served by exactly one node (with node keys: the
node holding that client's key), and a second claimant is refused without stopping the run. Before every round
it takes in nodes that connected since: a SuperNode restarted with its state directory continues its client.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedllm.flower import FEDERATION_INCOMPLETE
from fedllm.flower.adapter import ClientFailed, FedllmStrategy, recipe_for_nodes
from fedllm.models.state import StateDict

log = logging.getLogger("fedllm")


class FederationIncomplete(RuntimeError):
    """Fewer SuperNodes claimed the recipe's clients than ``federation.num_clients`` within the wait."""

    MARKER = FEDERATION_INCOMPLETE


class FlowerExecutor:
    """The round loop's executor over a Flower :class:`Grid`.

    Args:
        grid: the ServerApp's grid.
        timeout: seconds to wait for a round's replies.
        probe_mb: size of the transport probe sent to every node at discovery (0: none).
        wait_nodes: seconds to wait, at start, for one SuperNode per client (reported every ``report_s``).
        node_keys: client id -> the public key (PEM) its node must authenticate with (``fedllm flower certs``);
            None: any node may claim a free client id (``--insecure-nodes``).
        poll_s: the longest wait between two requests for replies; after a push and after each reply the
            ServerApp asks again after ``first_poll_s``, doubling up to ``poll_s``
            (:class:`~fedllm.flower.backoff.Backoff`).
        first_poll_s: the first wait after a push or a reply.
        sleep: how to wait (tests record the waits).
        node_wait: seconds a round waits for a sampled client's offline SuperNode to come back (a restart).
    """

    is_main = True
    runs_secure_aggregation = True  # privacy.secure_aggregation: secagg_plus (fedllm.flower.secagg_stages)

    def __init__(self, grid: Grid, timeout: float = 3600.0, probe_mb: float = 0.0, wait_nodes: float = 120.0,
                 node_keys: dict[int, bytes] | None = None, report_s: float = 5.0, poll_s: float = 0.25,
                 node_wait: float = 300.0, first_poll_s: float = 0.02, sleep: Any = time.sleep):
        self.grid = grid
        self.timeout = timeout
        self.probe_mb = probe_mb
        self.wait_nodes = wait_nodes
        self.node_keys = node_keys
        self.report_s = report_s
        self.poll_s = poll_s
        self.first_poll_s = first_poll_s
        self.sleep = sleep
        self.node_wait = node_wait
        self.num_clients = 0
        self.origin: dict[str, int] = {}  # message id -> the node it was sent to
        self.token = uuid.uuid4().hex[:16]
        self.recipe_yaml = ""
        self.adapter: FedllmStrategy | None = None
        self.synced: dict[int, int] = {}
        self.steps: dict[int, int] = {}
        self.checkpointed: dict[int, int] = {}  # beliefs in the newest checkpoint
        self.probe: dict[int, tuple[int, float]] = {}  # client -> (bytes received, sum) of the probe
        self.refused: set[int] = set()  # nodes whose claim was refused (never asked again)
        self.silent: dict[int, float] = {}  # nodes that did not answer a query -> when (asked again after a minute)

    def bind(self, loop: Any) -> FedllmStrategy:
        """The adapter for ``loop``, connected to the nodes (once)."""
        if self.adapter is None:
            self.adapter = FedllmStrategy(loop, self.token)
            self.adapter.synced = dict(self.synced)
            self.adapter.steps = dict(self.steps)
            self.adapter.origin = self.origin
            self.num_clients = loop.recipe.federation.num_clients
            self.recipe_yaml = recipe_for_nodes(loop.recipe)  # sent with the query: node workers build the model then
            self.adapter.recipe_yaml = self.recipe_yaml  # and with every message: the same text, one build per run
            self.adapter.nodes = self.discover(loop.recipe.federation.num_clients)
            self.record_nodes(loop)
        return self.adapter

    def record_nodes(self, loop: Any) -> None:
        """Write which SuperNode serves which client, and how many are connected, for the operator's status page
        (``fedllm flower status``; :func:`fedllm.runs.live_status.write_federation`)."""
        from fedllm.runs.live_status import write_federation

        write_federation(loop.run_dir, self.adapter.nodes, len(self.connected()))

    # ----- which node serves which client
    def connected(self) -> dict[int, bytes]:
        """Node id -> its public key (b"" when unknown or unauthenticated) of the nodes connected now."""
        try:
            return {int(n.node_id): bytes(n.public_key) for n in self.grid.get_nodes()}
        except (AttributeError, NotImplementedError):
            return {int(n): b"" for n in self.grid.get_node_ids()}

    def ask(self, nodes: list[int], timeout: float) -> dict[int, int]:
        """Node id -> the client id it claims (``query.fedllm``; with the transport probe), for those that answer."""
        import numpy as np

        probe = None
        if self.probe_mb:
            probe = np.random.default_rng(0).random(int(self.probe_mb * 2**20 / 4), dtype=np.float32)
        messages = []
        for node in sorted(nodes):
            content = RecordDict({"fedllm": ConfigRecord({"token": self.token, "recipe": self.recipe_yaml})})
            if probe is not None:
                content["probe"] = ArrayRecord([probe])
            messages.append(Message(content, dst_node_id=node, message_type="query.fedllm"))
        claims: dict[int, int] = {}
        started = time.monotonic()
        # a node gone offline (killed without signing off, its session not yet timed out) is not waited for: back, it
        # is a connected node again and asked then (before: each such node held the start for node_wait, 300 s)
        for m in self.send(messages, timeout, node_wait=0.0):
            if m.has_error():
                log.warning("node %s failed to say which client it serves: %s", m.metadata.src_node_id, m.error.reason)
                continue
            info = m.content.metric_records["info"]
            cid = int(info["client_id"])
            claims[m.metadata.src_node_id] = cid
            got = (int(info["probe_bytes"]), float(info["probe_sum"]))
            if probe is not None:
                expected = (probe.nbytes, float(probe.astype("float64").sum()))
                if got[0] != expected[0] or abs(got[1] - expected[1]) > 1e-6 * abs(expected[1]):
                    raise ClientFailed(f"client {cid}: transport probe came back as {got}, sent {expected}")
            self.probe[cid] = got
        if probe is not None and claims:
            seconds = time.monotonic() - started
            log.info("transport probe: %.1f MB to %d node(s) and their answers in %.2f s (%.1f MB/s)",
                     probe.nbytes / 1e6, len(claims), seconds, probe.nbytes * len(claims) / 1e6 / seconds)
        return claims

    def refusal(self, node: int, cid: int, key: bytes, nodes: dict[int, int], num_clients: int) -> str | None:
        """Why node ``node`` may not serve client ``cid`` (None: it may)."""
        if not 0 <= cid < num_clients:
            return f"it claims client {cid}; this federation has clients 0..{num_clients - 1}"
        if self.node_keys is not None and _same_key(key, self.node_keys.get(cid)) is False:
            return f"it claims client {cid} but did not authenticate with client {cid}'s key"
        if cid in nodes and nodes[cid] != node:
            return f"client {cid} is already served by node {nodes[cid]}"
        return None

    def claim(self, claims: dict[int, int], keys: dict[int, bytes], nodes: dict[int, int], num_clients: int) -> None:
        """Add the acceptable ``claims`` (node -> client) to ``nodes`` (client -> node); refuse the rest, loudly."""
        for node, cid in sorted(claims.items()):
            why = self.refusal(node, cid, keys.get(node, b""), nodes, num_clients)
            if why is None:
                nodes[cid] = node
                continue
            self.refused.add(node)
            note = f"fedllm: SuperNode {node} refused: {why}"
            log.warning("%s", note)
            print(note, flush=True)

    def discover(self, num_clients: int) -> dict[int, int]:
        """Client id -> node id, one SuperNode per client; reports progress every ``report_s`` while it waits.

        ``wait_nodes`` bounds the wait for SuperNodes to *connect*; a node that is connected but has not said yet
        which client it serves (busy: serving another run, or a loaded machine) is asked once more at the end and
        given the round timeout to answer, so the clock never counts a slow node as a missing one.

        Raises :class:`FederationIncomplete` when some client has no node after ``wait_nodes`` seconds.
        """
        t0 = time.monotonic()
        deadline, reported = t0 + self.wait_nodes, None
        nodes: dict[int, int] = {}
        while True:
            keys = self.connected()
            new = [n for n in keys if n not in nodes.values() and n not in self.refused]
            if new:
                self.claim(self.ask(new, max(1.0, min(30.0, deadline - time.monotonic()))), keys, nodes, num_clients)
            if not self._missing(nodes, num_clients):
                return nodes
            now = time.monotonic()
            if now > deadline:
                unheard = [n for n in keys if n not in nodes.values() and n not in self.refused]
                if unheard:  # connected, not heard from: their answer decides, not the clock
                    self.claim(self.ask(unheard, self.timeout), keys, nodes, num_clients)
                    if not self._missing(nodes, num_clients):
                        return nodes
                    keys = self.connected()  # without those gone offline meanwhile
                status = self._status(keys, nodes, num_clients)
                raise FederationIncomplete(f"{FederationIncomplete.MARKER}: {status} after {self.wait_nodes:.0f}s")
            if reported is None or now - reported >= self.report_s:
                reported = now
                print(f"fedllm: waiting {deadline - now:.0f}s more for SuperNodes: "
                      f"{self._status(keys, nodes, num_clients)}", flush=True)
            time.sleep(0.5)

    @staticmethod
    def _missing(nodes: dict[int, int], num_clients: int) -> list[int]:
        return sorted(set(range(num_clients)) - set(nodes))

    def _status(self, keys: dict[int, bytes], nodes: dict[int, int], num_clients: int) -> str:
        return (f"{len(keys)} SuperNode(s) connected, {len(nodes)} of {num_clients} clients served "
                f"(missing: {self._missing(nodes, num_clients)}); one SuperNode per client is needed "
                "(fedllm flower supernode --client K)")

    def rejoin(self, num_clients: int) -> None:
        """Take in SuperNodes that connected since the last round: a restarted node takes its client back."""
        adapter = self.adapter
        keys, now = self.connected(), time.monotonic()
        new = [n for n in keys if n not in adapter.nodes.values() and n not in self.refused
               and now - self.silent.get(n, -1e9) > 60.0]
        if not new:
            return
        claims = self.ask(new, 10.0)
        self.silent.update({n: now for n in new if n not in claims})
        for node, cid in sorted(claims.items()):
            old = adapter.nodes.get(cid)
            if old is not None and old != node and (old not in keys or not self.ask([old], 10.0)):
                del adapter.nodes[cid]  # its node is gone: whoever may serve the client now takes it
            before = adapter.nodes.get(cid)
            self.claim({node: cid}, keys, adapter.nodes, num_clients)
            if adapter.nodes.get(cid) == node and before != node:
                note = f"fedllm: client {cid} rejoined on SuperNode {node}"
                log.warning("%s", note)
                print(note, flush=True)

    def send(self, messages: list[Message], timeout: float | None = None, deadline: Any = None,
             arrived: dict[int, float] | None = None, node_wait: float | None = None) -> list[Message]:
        """Push ``messages`` and collect their replies until all came, ``timeout`` or ``deadline(arrival times)`` (a
        round deadline: seconds from the push, given the replies' arrival times so far); each reply's arrival, in
        seconds from the push, goes into ``arrived`` by the node the message went to. Asking again after
        ``first_poll_s`` once pushed and after every reply, doubling up to ``poll_s`` while none comes (a SecAgg+
        stage's answers arrive a few hundred ms after the push, a training's after minutes).

        A message whose SuperNode is offline (the SuperLink answers ``NODE_UNAVAILABLE``) is sent again when
        that client's node is back (the same node id, or a new node that claims the client), for up to
        ``node_wait`` seconds (``self.node_wait`` unless given); then its error is the reply. ``self.origin`` maps every message id to the
        node it went to (the SuperLink's own error replies come from node 0).
        """
        from flwr.common.constant import ErrorCode

        from fedllm.flower.backoff import Backoff

        if not messages:
            return []
        timeout = self.timeout if timeout is None else timeout
        node_wait = self.node_wait if node_wait is None else node_wait
        try:
            pending = self._push(messages)
        except NotImplementedError:  # a grid without the push/pull interface (tests' loopback grid)
            return list(self.grid.send_and_receive(messages, timeout=timeout))
        start = time.monotonic()
        round_deadline, deadline, replies, offline, checked = deadline, start + timeout, [], {}, start
        wait = Backoff(self.first_poll_s, self.poll_s, self.sleep)
        while pending or offline:
            for m in self.grid.pull_messages(set(pending)) if pending else []:
                wait.reset()  # the other nodes' answers are often close behind
                if arrived is not None and not m.has_error():
                    arrived[self.origin.get(m.metadata.reply_to_message_id, m.metadata.src_node_id)] = \
                        time.monotonic() - start
                sent = pending.pop(m.metadata.reply_to_message_id, None)
                if (m.has_error() and m.error.code == ErrorCode.NODE_UNAVAILABLE and sent is not None
                        and time.monotonic() - start < min(timeout, node_wait)):
                    offline[m.metadata.reply_to_message_id] = (sent, m)  # wait for the node to come back
                else:
                    replies.append(m)
            now = time.monotonic()
            if offline and now - checked > 3.0:
                checked = now
                again = self._resend_to_returned(offline)
                if again:
                    wait.reset()
                pending.update(again)
            if offline and now - start >= min(timeout, node_wait):
                replies += [err for _, err in offline.values()]
                offline = {}
            if (not pending and not offline) or now > deadline:
                break
            if round_deadline is not None and now - start > round_deadline(list((arrived or {}).values())):
                log.warning("round deadline reached after %.1f s: %d message(s) without a reply", now - start,
                            len(pending) + len(offline))
                break
            wait.wait()
        return replies

    def _push(self, messages: list[Message]) -> dict[str, Message]:
        ids = list(self.grid.push_messages(messages))
        for m, i in zip(messages, ids):
            self.origin[i] = m.metadata.dst_node_id
        return {i: m for m, i in zip(messages, ids) if i}

    def _resend_to_returned(self, offline: dict[str, tuple[Message, Message]]) -> dict[str, Message]:
        """Copies of the messages in ``offline`` whose client's node is connected again, pushed to it now."""
        adapter = self.adapter
        if adapter is not None and self.num_clients:
            self.rejoin(self.num_clients)
        connected = self.connected()
        by_node = {n: c for c, n in adapter.nodes.items()} if adapter is not None else {}
        again = []
        for key, (sent, _) in list(offline.items()):
            cid = by_node.get(sent.metadata.dst_node_id, (adapter.sent if adapter else {}).get(sent.metadata.dst_node_id))
            node = adapter.nodes.get(cid, sent.metadata.dst_node_id) if adapter is not None else sent.metadata.dst_node_id
            if node in connected:
                del offline[key]
                copy = Message(sent.content, dst_node_id=node, message_type=sent.metadata.message_type)
                if adapter is not None and cid is not None:
                    adapter.sent[node] = cid
                again.append(copy)
                log.warning("client %s: its SuperNode is back (node %s); message sent again", cid, node)
        return self._push(again) if again else {}

    # ----- the executor interface of fedllm.engine.server.RoundLoop
    def train(self, loop: Any, rnd: int, sampled: list[int], lr: float,
              bar: Any) -> tuple[list[Any], dict[int, int], dict[int, str]]:
        adapter = self.bind(loop)
        self.rejoin(loop.recipe.federation.num_clients)
        self.record_nodes(loop)
        missing = [c for c in sampled if c not in adapter.nodes]
        if missing:
            raise ClientFailed(f"round {rnd}: no SuperNode serves client(s) {missing}")
        if loop.recipe.privacy.secure_aggregation == "secagg_plus":  # SecAgg+'s stages around the train messages
            from fedllm.flower.secagg_stages import train_secure

            return train_secure(self, loop, rnd, sampled, lr, bar)
        messages = adapter.configure_train(rnd, ArrayRecord(), ConfigRecord({"sampled": sampled, "lr": lr}),
                                           self.grid)
        down = dict(adapter.bytes_down)
        updates, dropped = self.collect_uploads(loop, rnd, list(messages))
        if bar is not None:
            bar.update(sum(u.steps for u in updates))
        return updates, down, dropped

    def collect_uploads(self, loop: Any, rnd: int, messages: list[Message]) -> tuple[list[Any], dict[int, str]]:
        """Send a round's train messages and decode the uploads, collecting until every client answered, the
        timeout, or the round's deadline (``federation.round_deadline``, which the round loop owns: its
        :meth:`~fedllm.engine.server.RoundLoop.drop_late` drops the late uploads, and a client with no reply by
        the deadline is late too). Each upload carries its arrival in seconds from the push."""
        from fedllm.flower.adapter import NO_REPLY

        adapter, arrived = self.adapter, {}
        limit = None
        if loop.deadline is not None:
            def limit(times: list[float]) -> float:
                return loop.deadline.limit(times, len(messages))
        updates, dropped = adapter.decode_updates(rnd, self.send(messages, deadline=limit, arrived=arrived))
        for u in updates:
            u.arrival_s = arrived.get(adapter.nodes.get(u.client_id))
        silent = [c for c, why in dropped.items() if why == NO_REPLY] if limit is not None else []
        for cid in silent:  # no reply by the deadline: late, not failed
            del dropped[cid]
        return loop.drop_late(rnd, updates, len(messages), dropped, silent), dropped

    def sync(self, loop: Any, rnd: int, sampled: list[int], aggregated: StateDict) -> dict[int, int]:
        """Keep the aggregate for catch-up; after the last round bring every node to the final model."""
        adapter = self.bind(loop)
        adapter.keep_aggregate(rnd, aggregated)
        sent: dict[int, int] = {}
        if rnd == loop.recipe.federation.rounds:
            adapter.note_synced(self.send(adapter.configure_sync(rnd, range(loop.recipe.federation.num_clients))))
            sent = dict(adapter.bytes_down)
        self.synced, self.steps = dict(adapter.synced), dict(adapter.steps)
        return sent

    def state(self) -> dict[str, Any]:
        """Called when a checkpoint is written: the run token and how far each node is synced."""
        if self.adapter is not None:  # aggregates the checkpoint before this one needed are not needed now
            self.adapter.prune_aggregates(self.checkpointed)
        self.checkpointed = dict(self.synced)
        return {"token": self.token, "synced": {str(c): r for c, r in self.synced.items()},
                "steps": {str(c): r for c, r in self.steps.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("token"):
            self.token = state["token"]
            self.synced = {int(c): int(r) for c, r in state.get("synced", {}).items()}
            self.steps = {int(c): int(r) for c, r in state.get("steps", {}).items()}
            self.checkpointed = dict(self.synced)


def _same_key(key: bytes, registered: bytes | None) -> bool | None:
    """Whether a node's public key (PEM) is ``registered`` (None: the node's key is not known here)."""
    if registered is None:
        return False
    if not key:
        return None  # a grid that does not report keys (tests' loopback grid): the SuperLink's auth decides
    from cryptography.hazmat.primitives import serialization

    def raw(pem: bytes) -> bytes:
        return serialization.load_pem_public_key(pem).public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)

    return raw(key) == raw(registered)
