"""SecAgg+ on Flower (``privacy.secure_aggregation: secagg_plus``): the protocol's stages as messages between fedllm's
ServerApp and the node workers, around the round's ``train`` message.

Per round (Bell et al., CCS 2020, Fig. 4; the same code as in simulation, :mod:`fedllm.engine.secure_rounds`):

0. ``query.secagg`` ``hello`` → only a sampled node whose encryption key the ServerApp does not hold yet (its first
   SecAgg+ round of the run, or after it failed in a round, e.g. its worker restarted): the node's long-lived X25519
   encryption key ``c_u`` (one per run and worker, its private half in the worker's memory only and never revealed),
   signed with its node key (:func:`fedllm.privacy.secagg.identity.sign_encryption_key`).
1. ``query.secagg`` ``keys`` → every sampled node with a known key: the round's public parameters, the encryption
   keys of every sampled node that has one with their signatures, and the neighbour graph's seed; the node verifies
   every signature against its own copy of the registered node public keys (a key substituted by the server is
   refused) and recomputes the graph seed from those keys (:func:`graph_seed_of`; a seed that differs, or a key set
   missing more clients than the quorum allows, is refused: the server cannot choose the neighbourhoods by trying
   nonces), makes the round's secrets
   (:class:`fedllm.privacy.secagg.SecAggClient`, in the worker's memory only) and answers, in one message, the
   round's fresh masking key ``s_u`` (signed with its node key over the round's context and both keys) and its
   shares encrypted to the neighbours' encryption keys: the key advertisement rides on the share exchange.
2. ``train`` with a ``secagg`` record: the shares routed to the node and its neighbours' signed keys of the round;
   the node verifies them, trains as always and answers only its masked, quantised change (``secagg/masked``)
   instead of its update.
3. ``query.secagg`` ``check`` → the nodes whose masked input arrived: the survivor list ``U3`` (and who dropped);
   each node signs the round's context and ``U3`` with its node key — one list per round (Bonawitz et al., CCS 2017,
   §4, ConsistencyCheck).
4. ``query.secagg`` ``unmask`` → the nodes that signed: every survivor's signature; each node verifies them against
   its copy of the registered node keys, and only when a quorum (:meth:`SecAggParams.quorum`) signed the very list it
   signed does it answer its shares (of seeds for survivors, of masking keys for the others) and forget the round's
   secrets. A server that tells some nodes that a client dropped and others that it survived gets no quorum.

Every ``query.secagg`` message and answer carries the protocol's version (:data:`PROTOCOL_VERSION`): a node or a
ServerApp of another version refuses the round with a message saying so (the other side answers an error at once,
never a hang).

The server's steps (:class:`fedllm.engine.secure_rounds.SecureRoundServer`) unmask the sum; the round loop hands
the strategy the round's mean upload (``aggregate_mean``), as in simulation, so a Flower run equals the one-process
SecAgg+ run. A node lost after stage 1 (its worker killed, its SuperNode gone, an error) is a dropout: up to
``privacy.secagg.max_dropouts`` of them the round completes; beyond, it fails like a round with too few updates
(retried or stopped, then resumed). A restarted worker has lost its client's secrets (they are never written to
disk, its journal included): it answers the round's remaining messages with an error, i.e. it drops out, and
says hello again in the next round it is sampled for. A worker that restarts between two rounds without the ServerApp
noticing misses the next round it is sampled for (its neighbours encrypted its shares to its old key: it refuses
the ``keys`` message, is lost before sharing and says hello in the round after).

Extra round trips per round: 3 (``keys``, ``check``, ``unmask``), 4 in a node's first round (``hello``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

from flwr.app import ConfigRecord, Message, RecordDict

from fedllm.engine.secure_rounds import SecureRoundServer, mask_upload
from fedllm.privacy.secagg import (
    EncryptedShare,
    KeyAdvert,
    SecAggClient,
    SecAggError,
    SecAggParams,
    SecAggServer,
    ShareReveal,
    SurvivorSignature,
    UnmaskRequest,
    crypto,
    identity,
)
from fedllm.privacy.secagg.encoding import Layout

log = logging.getLogger("fedllm")

RECORD = "secagg"
"""Name of the ConfigRecord that carries a stage's fields (and the shares of a ``train`` message)."""
MESSAGE_TYPE = "query.secagg"
PROTOCOL_VERSION = 3
"""Version of the stages' wire format: 3 derives the neighbour graph's seed from the round's encryption keys (every
key in the ``keys`` message, checked by each node); 2 added the consistency check (``check`` and signed survivor
lists) and the long-lived encryption keys (``hello``; ``keys`` replaced ``advertise`` and ``share``); 1 (no
``version`` field) had neither."""
NODE_KEY, PEER_KEYS = "node-key", "peer-keys"
"""``--node-config`` entries: this node's private key (it signs its SecAgg+ keys) and the directory of every client's
registered node public key (``client-K.pub``: the signatures of its neighbours' keys are checked against them)."""


# ----- the node side (the worker keeps each client's secrets in memory)
@dataclass
class NodeRound:
    """A client's secrets and parameters of its current SecAgg+ round (in the worker's memory only)."""

    rnd: int
    context: bytes
    client: SecAggClient


_ROUNDS: dict[tuple[str, int], NodeRound] = {}  # (run token, client id) -> its round in progress
_ENCRYPTION_KEYS: dict[tuple[str, int], Any] = {}  # (run token, client id) -> its long-lived X25519 private key
_KNOWN_KEYS: dict[tuple[str, int], tuple[bytes, bytes]] = {}
"""On the ServerApp: (run token, client id) -> the node's encryption key and its signature, from its ``hello``."""


def graph_seed_of(token: str, rnd: int, sampled: list[int], keys: dict[int, bytes]) -> bytes:
    """The neighbour graph's seed of a round on Flower: SHA-256 of the run's token, the round, the sample and the
    long-lived encryption key of every sampled client that takes part (by client id). Each key was made by its node
    after the token was chosen and is signed by its node key, so the server can neither pick the seed nor predict it
    before the keys exist; what it still picks is which clients' keys it forwards (at least the quorum; each one
    left out is a visible dropout, and the sample itself)."""
    named = repr(("fedllm-secagg-graph", token, int(rnd), sorted(int(c) for c in sampled),
                  sorted((int(c), bytes(k).hex()) for c, k in keys.items())))
    return hashlib.sha256(named.encode()).digest()[:16]


def _check_graph(cfg: Any, cid: int, token: str, rnd: int, params: SecAggParams, sampled: list[int],
                 who: identity.Identity) -> dict[int, bytes]:
    """The node's check of the ``keys`` message's graph: every forwarded key verified, enough of them, and the seed
    the hash of them (:func:`graph_seed_of`); the keys by client."""
    keyed = {int(c): bytes(k) for c, k in zip(cfg["keyed_ids"], cfg["keyed_keys"], strict=True)}
    if who.peer_keys is not None:
        for c, signature in zip(cfg["keyed_ids"], cfg["keyed_signatures"], strict=True):
            identity.verify_encryption_key(who.peer_keys, int(c), keyed[int(c)], bytes(signature))
    quorum = params.quorum(len(sampled))
    if not set(keyed) <= set(sampled) or len(keyed) < quorum:
        raise SecAggError(f"client {cid}: refused the round's neighbour graph: keys of {sorted(keyed)} for the sample "
                          f"{sampled} (at least {quorum} sampled clients' keys are needed)")
    derived = graph_seed_of(token, rnd, sampled, keyed)
    if bytes(cfg["graph_seed"]) != derived:
        raise SecAggError(f"client {cid}: refused the round's neighbour graph: its seed "
                          f"{bytes(cfg['graph_seed']).hex()} is not the hash of the round's encryption keys "
                          f"({derived.hex()}): a server may not choose the neighbourhoods")
    return keyed


def _open_round(token: str, cid: int, rnd: int, context: bytes) -> NodeRound:
    current = _ROUNDS.get((token, cid))
    if current is None or current.rnd != rnd or current.context != context:
        raise SecAggError(f"client {cid}: no SecAgg+ secrets for round {rnd} on this node (its worker restarted since "
                          "the key exchange, or it runs each message in a fresh process: SecAgg+ needs fedllm's node "
                          "worker): it drops out of the round")
    return current


def _request(cfg: Any) -> UnmaskRequest:
    return UnmaskRequest(tuple(int(c) for c in cfg["survivors"]), tuple(int(c) for c in cfg["dropped"]))


def _node_identity(context: Any) -> identity.Identity:
    """The node's signing key and its copy of the registered node public keys (each ``None`` when not configured)."""
    key_path, peers = context.node_config.get(NODE_KEY), context.node_config.get(PEER_KEYS)
    return identity.Identity(identity.load_signing_key(str(key_path)) if key_path else None,
                             identity.load_peer_keys(str(peers)) if peers else None)


def _share(cfg: Any, cid: int, token: str, rnd: int, ctx: bytes, who: identity.Identity) -> dict[str, Any]:
    """The ``keys`` stage on the node: the round's secrets, its signed masking key and its encrypted shares."""
    params = SecAggParams(**json.loads(str(cfg["params"])))
    sampled = [int(c) for c in cfg["sampled"]]
    problems = params.problems(len(sampled))
    if problems or cid not in sampled:
        raise SecAggError(f"client {cid}: refused SecAgg+ parameters {params} for clients {sampled}: "
                          + ("; ".join(f"{k} must be {w}" for k, w in problems) or "this client is not sampled"))
    key = _ENCRYPTION_KEYS.get((token, cid))
    if key is None or crypto.public_of(key)[1] != bytes(cfg["own_key"]):
        raise SecAggError(f"client {cid}: its SecAgg+ encryption key is not the one the ServerApp holds (its worker "
                          "restarted since it said hello): it sits this round out and says hello again")
    peers = [KeyAdvert(int(c), bytes(e), b"") for c, e in zip(cfg["ids"], cfg["encryption_keys"], strict=True)]
    if who.peer_keys is not None:
        for advert, signature in zip(peers, cfg["key_signatures"], strict=True):
            identity.verify_encryption_key(who.peer_keys, advert.client_id, advert.encryption_key, bytes(signature))
    else:
        log.warning("client %d: SecAgg+ keys of its neighbours taken unverified (no peer keys: fedllm flower "
                    "supernode --auth-key/--peer-keys): a server could substitute them", cid)
    keyed = _check_graph(cfg, cid, token, rnd, params, sampled, who)
    if keyed.get(cid) != bytes(cfg["own_key"]):
        raise SecAggError(f"client {cid}: refused the round's neighbour graph: it was not built from this node's key")
    if any(keyed.get(a.client_id) != a.encryption_key for a in peers):
        raise SecAggError(f"client {cid}: a neighbour's key differs from the one the graph was built from: refused")
    client = SecAggClient(cid, params, sampled, bytes(cfg["graph_seed"]), ctx, who, encryption_key=key)
    _ROUNDS[(token, cid)] = NodeRound(rnd, ctx, client)
    shares = client.share_keys(peers)
    advert = client.advertise()
    log.info("client %d: SecAgg+ round %d: keys verified, %d shares sent", cid, rnd, len(shares))
    return {"masking_key": advert.masking_key,
            "signature": identity.sign(who.signing_key, ctx, advert) if who.signing_key else b"",
            "receivers": [s.receiver for s in shares], "sealed": [s.sealed for s in shares]}


def answer_stage(msg: Message, context: Any) -> Message:
    """A node's answer to a ``query.secagg`` message (key advertisement, share exchange, consistency check,
    unmasking)."""
    from fedllm.flower.node import NodeConfig

    cid = NodeConfig.parse(dict(context.node_config)).client_id
    cfg = msg.content.config_records[RECORD]
    version = int(cfg.get("version", 1))
    if version != PROTOCOL_VERSION:
        raise SecAggError(f"client {cid}: the ServerApp speaks SecAgg+ protocol version {version}, this node "
                          f"{PROTOCOL_VERSION} (version 3 derives the neighbour graph from the nodes' keys, 2 added the "
                          "consistency check of the survivor list): refused; "
                          "run the same fedllm on the ServerApp and the nodes")
    stage, token, rnd, ctx = str(cfg["stage"]), str(cfg["token"]), int(cfg["round"]), bytes(cfg["context"])
    who = _node_identity(context)
    if stage == "hello":
        key = _ENCRYPTION_KEYS.setdefault((token, cid), crypto.new_key_pair()[0])
        public = crypto.public_of(key)[1]
        signature = identity.sign_encryption_key(who.signing_key, cid, public) if who.signing_key else b""
        out = {"encryption_key": public, "signature": signature}
    elif stage == "keys":
        out = _share(cfg, cid, token, rnd, ctx, who)
    elif stage == "check":
        current = _open_round(token, cid, rnd, ctx)
        out = {"signature": current.client.check(_request(cfg))}
        log.info("client %d: SecAgg+ round %d: survivor list signed", cid, rnd)
    elif stage == "unmask":
        current = _open_round(token, cid, rnd, ctx)
        if current.client.who.peer_keys is None:
            log.warning("client %d: SecAgg+ survivor list taken unverified (no peer keys: fedllm flower supernode "
                        "--auth-key/--peer-keys): a server lying about dropouts is not detected", cid)
        signatures = {int(c): bytes(s) for c, s in zip(cfg["signers"], cfg["signatures"], strict=True)}
        try:
            reveals = current.client.unmask(_request(cfg), signatures)
        finally:
            del _ROUNDS[(token, cid)]  # asked once, answered or refused: a second request finds no secret to reveal
        out = {"owners": [r.owner for r in reveals], "kinds": [r.kind for r in reveals],
               "indices": [r.index for r in reveals], "shares": [r.share for r in reveals]}
        log.info("client %d: SecAgg+ round %d: %d shares revealed", cid, rnd, len(reveals))
    else:
        raise SecAggError(f"client {cid}: unknown SecAgg+ stage {stage!r}")
    return Message(RecordDict({RECORD: ConfigRecord({"client_id": cid, "version": PROTOCOL_VERSION, **out})}),
                   reply_to=msg)


def check_secrets(msg: Message, cid: int) -> None:
    """Before a ``train`` message of a SecAgg+ round is trained: this worker still holds the client's secrets, and
    the neighbours' keys of the round verify (a masking key substituted by the server is refused)."""
    cfg = msg.content.config_records.get(RECORD)
    if cfg is not None:
        head = msg.content.config_records["fedllm"]
        current = _open_round(str(head["token"]), cid, int(head["round"]), bytes(cfg["context"]))
        adverts = [KeyAdvert(int(c), bytes(e), bytes(m)) for c, e, m in
                   zip(cfg["ids"], cfg["encryption_keys"], cfg["masking_keys"], strict=True)]
        if current.client.who.peer_keys is not None:
            for advert, signature in zip(adverts, cfg["signatures"], strict=True):
                identity.verify(current.client.who.peer_keys, current.context, advert, bytes(signature))
        current.client.learn_masking_keys(adverts)
        log.info("client %d: SecAgg+ round %d: training (secrets held)", cid, int(head["round"]))


def masked_update(msg: Message, node: Any, update: Any, reference: dict) -> Any:
    """Stage 3 on the node: ``update`` as its masked words (the shares routed to it opened, the mask added)."""
    from fedllm.engine import client_faults
    from fedllm.models.state import cast

    cfg, head = msg.content.config_records[RECORD], msg.content.config_records["fedllm"]
    cid = node.config.client_id
    current = _open_round(str(head["token"]), cid, int(head["round"]), bytes(cfg["context"]))
    update.state = cast(update.state, node.recipe.federation.comm_dtype)
    problem = client_faults.update_problem(update, None)
    if problem is not None:
        raise SecAggError(f"client {cid}: its update cannot be aggregated ({problem}): it drops out of the round")
    shares = [EncryptedShare(int(s), cid, bytes(b)) for s, b in zip(cfg["senders"], cfg["sealed"], strict=True)]
    keys, shapes, weighted = json.loads(str(cfg["layout"]))
    layout = Layout(tuple(keys), tuple(tuple(s) for s in shapes), tuple(weighted))
    return mask_upload(update, reference, node.fed.strategy.sum_weight(update), node.recipe.seed, int(head["round"]),
                       layout, current.client.params, current.client, shares,
                       per_client_stats=node.recipe.privacy.per_client_stats)


# ----- the server side
class FlowerSecureRound(SecureRoundServer):
    """Stages 0-1 (``hello`` where needed, ``keys``) over the grid at construction, then the shares and the
    neighbours' keys for the ``train`` messages (:meth:`attach`), the consistency check and unmasking in
    :meth:`finish`. ``lost``: the sampled clients dropped before their shares were routed, and why.

    Args:
        executor: the :class:`fedllm.flower.executor.FlowerExecutor` (its grid, nodes and registered node keys).
        loop: the round loop.
        rnd: the round.
        sampled: the round's clients (each served by a node).
    """

    def __init__(self, executor: Any, loop: Any, rnd: int, sampled: list[int]):
        self.peer_keys = None
        if executor.node_keys:
            from cryptography.hazmat.primitives import serialization

            self.peer_keys = {c: serialization.load_pem_public_key(k) for c, k in executor.node_keys.items()}
        super().__init__(loop, rnd, sampled, salt=executor.token.encode() + os.urandom(16), peer_keys=self.peer_keys)
        self.executor, self.token, self.sampled = executor, executor.token, list(sampled)
        self.sent, self.received = dict.fromkeys(sampled, 0), dict.fromkeys(sampled, 0)
        self.lost: dict[int, str] = {}
        known = self._hello(sampled)
        ready = [c for c in sampled if c in known]
        # the graph: from the keys of the clients taking part, not from a nonce the server could choose
        self.graph_seed = graph_seed_of(self.token, rnd, sampled, {c: known[c][0] for c in ready})
        self.server = SecAggServer(self.params, sampled, self.graph_seed, self.context, self.peer_keys)
        answers = self._ask(ready, "keys", lambda c: self._keys_fields(c, known, ready))
        for c in ready:
            self.received[c] += sum(40 + len(known[v][1]) for v in ready)  # every taking-part key (with its id)
        adverts, signatures = [], {}
        for cid, a in sorted(answers.items()):
            advert = KeyAdvert(cid, known[cid][0], bytes(a["masking_key"]))
            try:
                if self.peer_keys is not None:
                    identity.verify(self.peer_keys, self.context, advert, bytes(a["signature"]))
            except SecAggError as e:
                self.lost[cid] = str(e)
                continue
            adverts.append(advert)
            signatures[cid] = bytes(a["signature"])
            self.sent[cid] += 32 + len(signatures[cid])
        for cid in self.lost:  # a node that failed says hello again (its worker may have restarted)
            _KNOWN_KEYS.pop((self.token, cid), None)
        self.keys, self.signatures = self.server.route_keys(adverts), signatures
        shares = [EncryptedShare(cid, int(v), bytes(b)) for cid, a in sorted(answers.items()) if cid in signatures
                  for v, b in zip(a["receivers"], a["sealed"], strict=True)]
        self.routed = self.server.route_shares(shares)
        for s in shares:
            if s.sender in self.server.u2:
                self.sent[s.sender] += len(s.sealed) + 16
        for c, got in self.routed.items():
            self.received[c] += sum(len(s.sealed) + 16 for s in got)
            self.received[c] += sum(64 + len(signatures[a.client_id]) for a in self.keys[c])
        for cid in sampled:
            if cid not in self.server.u2:
                self.lost.setdefault(cid, "lost during the secure-aggregation key and share exchange")

    def _hello(self, sampled: list[int]) -> dict[int, tuple[bytes, bytes]]:
        """The sampled clients' encryption keys and their signatures: those the ServerApp holds from earlier rounds,
        and, by a ``hello`` round trip, those of the nodes it holds none of (verified when it has the node keys)."""
        missing = [c for c in sampled if (self.token, c) not in _KNOWN_KEYS]
        answers = self._ask(missing, "hello", lambda c: {}) if missing else {}
        for cid, a in sorted(answers.items()):
            key, signature = bytes(a["encryption_key"]), bytes(a["signature"])
            try:
                if self.peer_keys is not None:
                    identity.verify_encryption_key(self.peer_keys, cid, key, signature)
            except SecAggError as e:
                self.lost[cid] = str(e)
                continue
            _KNOWN_KEYS[(self.token, cid)] = (key, signature)
            self.sent[cid] += 32 + len(signature)
        return {c: _KNOWN_KEYS[(self.token, c)] for c in sampled if (self.token, c) in _KNOWN_KEYS}

    def _keys_fields(self, c: int, known: dict[int, tuple[bytes, bytes]], ready: list[int]) -> dict[str, Any]:
        peers = [v for v in self.server.graph[c] if v in ready]
        return {"sampled": self.sampled, "params": json.dumps(self.params.to_dict()),
                "graph_seed": self.graph_seed, "own_key": known[c][0], "ids": peers,
                "encryption_keys": [known[v][0] for v in peers], "key_signatures": [known[v][1] for v in peers],
                "keyed_ids": ready, "keyed_keys": [known[v][0] for v in ready],
                "keyed_signatures": [known[v][1] for v in ready]}

    def _ask(self, clients: list[int], stage: str, fields) -> dict[int, Any]:
        """Send ``stage`` to the nodes of ``clients``; the ``secagg`` record of each client that answered."""
        nodes = self.executor.adapter.nodes
        messages = [Message(RecordDict({RECORD: ConfigRecord({
            "version": PROTOCOL_VERSION, "stage": stage, "token": self.token, "round": self.rnd, "context": self.context, **fields(c)})}),
            dst_node_id=nodes[c], message_type=MESSAGE_TYPE) for c in clients]
        by_node = {nodes[c]: c for c in clients}
        out = {}
        for m in self.executor.send(messages):
            cid = by_node.get(m.metadata.src_node_id, by_node.get(self.executor.origin.get(m.metadata.reply_to_message_id)))
            if cid is None:
                continue
            if m.has_error():
                old = " (an older fedllm on that node?)" if "unknown SecAgg+ stage" in m.error.reason else ""
                self.lost[cid] = f"secure aggregation ({stage}) failed on its node: {m.error.reason}{old}"
            elif int(m.content.config_records[RECORD].get("version", 1)) != PROTOCOL_VERSION:
                self.lost[cid] = (f"its node speaks SecAgg+ protocol version "
                                  f"{int(m.content.config_records[RECORD].get('version', 1))}, this ServerApp "
                                  f"{PROTOCOL_VERSION} (version 3 derives the neighbour graph from the nodes' "
                                  "keys, 2 added the consistency check of the survivor list): "
                                  "left out; run the same fedllm on the ServerApp and the nodes")
            else:
                out[cid] = m.content.config_records[RECORD]
                continue
            log.warning("round %d: client %d: %s", self.rnd, cid, self.lost[cid])
        return out

    def attach(self, messages: list[Message], sent: dict[int, int]) -> None:
        """Add to each ``train`` message (``sent``: node -> client) the shares routed to its client, its neighbours'
        signed keys of the round, the round's context and the layout the client encodes its change by."""
        layout = json.dumps([list(self.layout.keys), [list(s) for s in self.layout.shapes], list(self.layout.weighted)])
        for m in messages:
            cid = sent[m.metadata.dst_node_id]
            got, keys = self.routed.get(cid, []), self.keys.get(cid, [])
            m.content[RECORD] = ConfigRecord({
                "context": self.context, "layout": layout, "senders": [s.sender for s in got],
                "sealed": [s.sealed for s in got], "ids": [a.client_id for a in keys],
                "encryption_keys": [a.encryption_key for a in keys], "masking_keys": [a.masking_key for a in keys],
                "signatures": [self.signatures[a.client_id] for a in keys]})

    def finish(self, updates: list[Any]) -> tuple[list[Any], dict[int, str], dict[str, Any]]:
        """The consistency check and unmasking with the nodes of the survivors, then
        :meth:`SecureRoundServer.finish`."""
        return super().finish(updates, self.check, self.reveal)

    @staticmethod
    def _lists(request: UnmaskRequest) -> dict[str, list[int]]:
        return {"survivors": list(request.survivors), "dropped": list(request.dropped)}

    def check(self, request: UnmaskRequest) -> list[SurvivorSignature]:
        """The survivors' signatures of the survivor list (each survivor is sent ``U3``)."""
        answers = self._ask(list(request.survivors), "check", lambda c: self._lists(request))
        return [SurvivorSignature(cid, bytes(a["signature"])) for cid, a in sorted(answers.items())]

    def reveal(self, request: UnmaskRequest, signatures: dict[int, bytes]) -> list[ShareReveal]:
        """The shares the signers reveal once each is sent every survivor's signature of ``U3``."""
        signers = sorted(signatures)
        answers = self._ask(signers, "unmask", lambda c: {
            **self._lists(request), "signers": signers, "signatures": [signatures[v] for v in signers]})
        return [ShareReveal(cid, int(o), str(k), int(i), bytes(s)) for cid, a in sorted(answers.items())
                for o, k, i, s in zip(a["owners"], a["kinds"], a["indices"], a["shares"], strict=True)]


def train_secure(executor: Any, loop: Any, rnd: int, sampled: list[int], lr: float,
                 bar: Any) -> tuple[list[Any], dict[int, int], dict[int, str]]:
    """:meth:`FlowerExecutor.train` under SecAgg+: the stages around the ``train`` messages."""
    from flwr.app import ArrayRecord

    adapter = executor.adapter
    try:
        secure = FlowerSecureRound(executor, loop, rnd, sampled)
    except SecAggError as e:  # too few nodes answered the key or share exchange: this sample fails
        log.warning("round %d: secure aggregation cannot start: %s", rnd, e)
        return [], {}, {cid: f"secure aggregation cannot start: {e}" for cid in sampled}
    trained = sorted(secure.server.u2)
    messages = list(adapter.configure_train(rnd, ArrayRecord(), ConfigRecord({"sampled": trained, "lr": lr}),
                                            executor.grid))
    secure.attach(messages, adapter.sent)
    adapter.expected = dict.fromkeys(trained, secure.masked_upload_layout())
    down = dict(adapter.bytes_down)
    updates, dropped = executor.collect_uploads(loop, rnd, messages)  # with the round deadline
    if bar is not None:
        bar.update(sum(u.steps for u in updates))
    updates, lost, record = secure.finish(updates)
    for cid, why in {**secure.lost, **lost}.items():
        dropped.setdefault(cid, why)  # a client that failed on its node keeps that reason
    for cid in dropped:  # it says hello again when next sampled (its worker may have restarted, with a new key)
        _KNOWN_KEYS.pop((executor.token, cid), None)
    for u in updates:
        u.wire_bytes += secure.sent.get(u.client_id, 0)
    for cid, extra in secure.received.items():
        down[cid] = down.get(cid, 0) + extra
    if record:
        record["protocol_bytes_up"] = {str(c): b for c, b in sorted(secure.sent.items())}
    loop.secure_record = record
    for cid, why in dropped.items():
        log.warning("round %d: client %d dropped: %s", rnd, cid, why)
    return updates, down, dropped
