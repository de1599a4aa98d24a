"""A client's side of a SecAgg+ round (Bell et al., CCS 2020, Fig. 4 for the semi-honest server): one object
per client and round, holding its secrets; each stage takes what the server routed to it and returns what it
sends back.

1. :meth:`SecAggClient.advertise`: two X25519 key pairs, ``(c_u, s_u)``; the public halves go out. ``s_u`` is
   fresh each round; ``c_u`` too, or a Flower node's long-lived encryption key (its private half never leaves the
   worker's memory nor is revealed, so the key can serve every round: the node's neighbours then know it before
   the round, and the key advertisement rides on the share exchange, :mod:`fedllm.flower.secagg_stages`).
2. :meth:`SecAggClient.share_keys`: a fresh 256-bit self-mask seed ``b_u``; ``t``-of-``|N(u)|`` Shamir shares of
   ``b_u`` and of ``s_u``'s private key, one pair per neighbour, each encrypted with the key agreed from
   ``c_u`` and the neighbour's ``c_v`` (HKDF, ChaCha20-Poly1305, bound to the round and both ids). It needs the
   neighbours' encryption keys only; their masking keys may come later (:meth:`SecAggClient.learn_masking_keys`).
3. :meth:`SecAggClient.mask`: ``y_u = x_u + PRG(b_u) + Σ_{v ∈ N(u) ∩ U2} sign(u, v)·PRG(s_uv) mod 2^mod_bits``, with
   ``s_uv`` agreed from ``s_u`` and ``s_v`` and ``sign = +1`` when ``u < v``, else ``−1``: the pairwise masks
   of two clients cancel in the sum.
4. :meth:`SecAggClient.check` (Bonawitz et al., CCS 2017, §4, the actively secure protocol's ConsistencyCheck):
   the server sends the survivor list ``U3``; the client refuses one shorter than the quorum
   (:meth:`SecAggParams.quorum`) and signs the round's context and ``U3`` with its identity key — one list per
   round: it refuses to sign a second, different one.
5. :meth:`SecAggClient.unmask`: given the signatures the server collected, the client checks that a quorum of
   registered clients signed the very ``U3`` it signed, then reveals, for each neighbour that shared with it, the
   share of its seed ``b_v`` if ``v ∈ U3``, else of its masking key ``s_v`` — never both for one neighbour, and the
   same answer to any repeated request (a different list is refused). A server that tells some clients that ``u``
   dropped and others that it survived (to rebuild both ``b_u`` and ``s_u`` and unmask ``x_u``) gets no quorum for
   either list.
"""

from __future__ import annotations

import os
import struct

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedllm.privacy.secagg import crypto, identity, masks
from fedllm.privacy.secagg.graph import neighbour_graph
from fedllm.privacy.secagg.messages import EncryptedShare, KeyAdvert, MaskedInput, ShareReveal, UnmaskRequest
from fedllm.privacy.secagg.params import SecAggError, SecAggParams
from fedllm.privacy.secagg.quantize import word_dtype

_SHARE = struct.Struct("<qqH32s32s")  # sender, receiver, Shamir index, share of b, share of s^SK


def pair_info(purpose: bytes, context: bytes, u: int, v: int) -> bytes:
    """HKDF ``info`` of a pair's key: the purpose, the round's context and both ids (in order)."""
    a, b = sorted((u, v))
    return b"fedllm-secagg/" + purpose + b"/" + context + struct.pack("<qq", a, b)


def share_associated(context: bytes, sender: int, receiver: int) -> bytes:
    """What a share's encryption authenticates besides its plaintext: the round and the routing."""
    return b"fedllm-secagg/share/" + context + struct.pack("<qq", sender, receiver)


def mask_sign(u: int, v: int) -> int:
    """+1 when ``u < v``: ``u`` adds the pair's mask and ``v`` subtracts it."""
    return 1 if u < v else -1


class SecAggClient:
    """Client ``client_id``'s secrets and stages in one round (see the module docstring).

    Args:
        client_id: this client.
        params: the round's public parameters.
        client_ids: every client the server selected for the round.
        graph_seed: the public seed of the neighbour graph.
        context: bytes naming the round (run, round, attempt): every key, ciphertext and signature is bound to it.
        who: its identity key and the registered keys of its peers (the consistency check's signatures); without
            peer keys it cannot verify the others' signatures (a Flower node without ``--peer-keys``).
        encryption_key: a long-lived ``c_u`` (a Flower node's); ``None``: a fresh one.
    """

    def __init__(self, client_id: int, params: SecAggParams, client_ids: list[int], graph_seed: bytes, context: bytes,
                 who: identity.Identity | None = None, encryption_key: X25519PrivateKey | None = None):
        self.id, self.params, self.context, self.who = client_id, params, context, who or identity.Identity()
        self.round_size = len(set(client_ids))
        self.neighbours = neighbour_graph(client_ids, params.neighbours, graph_seed)[client_id]
        self.enc_sk, self.enc_pk = crypto.public_of(encryption_key) if encryption_key else crypto.new_key_pair()
        self.mask_sk, self.mask_pk = crypto.new_key_pair()
        self.seed = os.urandom(masks.SEED_BYTES)  # b_u
        self.peers: dict[int, KeyAdvert] = {}
        self.held: dict[int, tuple[int, bytes, bytes]] = {}  # neighbour -> (index, share of b_v, share of s_v)
        self.masked_with: list[int] = []
        self.signed: UnmaskRequest | None = None  # the one survivor list it signed this round
        self.answered: list[ShareReveal] | None = None

    # stage 1
    def advertise(self) -> KeyAdvert:
        """The two public keys."""
        return KeyAdvert(self.id, self.enc_pk, self.mask_pk)

    # stage 2
    def share_keys(self, adverts: list[KeyAdvert]) -> list[EncryptedShare]:
        """Encrypted shares of ``b_u`` and ``s_u^SK`` for each neighbour whose keys the server forwarded (their
        masking keys may be empty: learnt later, :meth:`learn_masking_keys`)."""
        t = self.params.threshold
        self.peers = {a.client_id: a for a in adverts if a.client_id in self.neighbours and a.client_id != self.id}
        if len(self.peers) != len(adverts):
            raise SecAggError(f"client {self.id}: keys of clients that are not its neighbours were forwarded")
        if len(self.peers) < t:
            raise SecAggError(
                f"client {self.id}: {len(self.peers)} neighbours advertised keys, fewer than the share threshold {t}"
            )
        self._distinct(adverts)
        order = sorted(self.peers)
        seed_shares = crypto.split(self.seed, t, len(order))
        key_shares = crypto.split(crypto.private_bytes(self.mask_sk), t, len(order))
        out = []
        for i, v in enumerate(order):
            key = crypto.agree(self.enc_sk, self.peers[v].encryption_key, pair_info(b"share", self.context, self.id, v))
            plain = _SHARE.pack(self.id, v, i + 1, seed_shares[i], key_shares[i])
            out.append(
                EncryptedShare(self.id, v, crypto.encrypt(key, plain, share_associated(self.context, self.id, v)))
            )
        return out

    def learn_masking_keys(self, adverts: list[KeyAdvert]) -> None:
        """The neighbours' masking keys of this round, when they come after the shares went out: each advert must
        carry the encryption key its shares were encrypted to (a neighbour outside the share exchange is ignored)."""
        for a in adverts:
            known = self.peers.get(a.client_id)
            if known is None:
                continue
            if a.encryption_key != known.encryption_key:
                raise SecAggError(f"client {self.id}: neighbour {a.client_id}'s encryption key changed after the share "
                                  "exchange: refused")
            self.peers[a.client_id] = a
        self._distinct(list(self.peers.values()))

    def _distinct(self, adverts: list[KeyAdvert]) -> None:
        keys = [a.encryption_key for a in adverts] + [a.masking_key for a in adverts if a.masking_key]
        if len(set(keys)) != len(keys):
            raise SecAggError(f"client {self.id}: two neighbours advertised the same public key")

    # stage 3
    def mask(self, values: np.ndarray, shares: list[EncryptedShare]) -> MaskedInput:
        """``values`` (integers of the word type, already quantised and weighted) masked; ``shares`` are the
        encrypted shares the neighbours that completed stage 2 sent to this client."""
        dtype = word_dtype(self.params)
        values = np.asarray(values)
        if values.dtype != dtype:
            raise SecAggError(f"client {self.id}: the input must be {dtype} words, got {values.dtype}")
        for s in shares:
            self.held[s.sender] = self._open(s)
        if len(self.held) < self.params.threshold:
            raise SecAggError(
                f"client {self.id}: shares from {len(self.held)} neighbours, fewer than the share "
                f"threshold {self.params.threshold}"
            )
        y = values + masks.expand(self.seed, values.size, dtype)
        self.masked_with = sorted(self.held)
        for v in self.masked_with:
            pair = masks.expand(self.pair_seed(v), values.size, dtype)
            y = y + pair if mask_sign(self.id, v) > 0 else y - pair
        return MaskedInput(self.id, y)

    def pair_seed(self, v: int) -> bytes:
        """``s_uv``: the seed of the pairwise mask with neighbour ``v``."""
        if not self.peers[v].masking_key:
            raise SecAggError(f"client {self.id}: neighbour {v}'s masking key never arrived")
        return crypto.agree(self.mask_sk, self.peers[v].masking_key, pair_info(b"mask", self.context, self.id, v))

    def _open(self, s: EncryptedShare) -> tuple[int, bytes, bytes]:
        if s.receiver != self.id or s.sender not in self.peers:
            raise SecAggError(f"client {self.id}: a share from {s.sender} to {s.receiver} was routed to it")
        key = crypto.agree(
            self.enc_sk, self.peers[s.sender].encryption_key, pair_info(b"share", self.context, self.id, s.sender)
        )
        try:
            plain = crypto.decrypt(key, s.sealed, share_associated(self.context, s.sender, self.id))
        except InvalidTag as e:
            raise SecAggError(f"client {self.id}: the share from client {s.sender} fails authentication") from e
        sender, receiver, index, seed_share, key_share = _SHARE.unpack(plain)
        if (sender, receiver) != (s.sender, self.id):
            raise SecAggError(f"client {self.id}: a share names {sender} -> {receiver}, routed {s.sender} -> {self.id}")
        return index, seed_share, key_share

    # consistency check
    def check(self, request: UnmaskRequest) -> bytes:
        """Sign the survivor list ``U3`` (``b""`` without an identity key): refused when it is shorter than the quorum,
        names both survivors and dropped clients, omits this client, or differs from a list signed before."""
        survivors, dropped = set(request.survivors), set(request.dropped)
        if survivors & dropped:
            raise SecAggError(
                f"client {self.id}: asked to reveal both secrets of clients {sorted(survivors & dropped)}"
            )
        if self.id not in survivors:
            raise SecAggError(f"client {self.id}: not among the survivors it is asked to unmask for")
        quorum = self.params.quorum(self.round_size)
        if len(survivors) < quorum:
            raise SecAggError(
                f"client {self.id}: {len(survivors)} survivors, fewer than "
                f"{self.params.quorum_text(self.round_size)}: refused to sign"
            )
        if self.signed is not None and self.signed != request:
            raise SecAggError(
                f"client {self.id}: asked to sign a second survivor list {list(request.survivors)} after "
                f"{list(self.signed.survivors)} in the same round: refused (a server lying about dropouts)"
            )
        self.signed = request
        key = self.who.signing_key
        return identity.sign_survivors(key, self.context, request.survivors) if key is not None else b""

    # stage 4
    def unmask(self, request: UnmaskRequest, signatures: dict[int, bytes]) -> list[ShareReveal]:
        """The shares the server needs, once ``signatures`` (client -> its signature of the survivor list) hold a
        quorum of valid ones over the list this client signed: of ``b_v`` for neighbours in ``U3``, of ``s_v^SK``
        for the other neighbours that shared with it."""
        if self.signed is None or self.signed != request:
            raise SecAggError(
                f"client {self.id}: asked to unmask for survivors {list(request.survivors)}, not the list it signed "
                f"({list(self.signed.survivors) if self.signed else 'none'}): refused (a server lying about dropouts)"
            )
        if self.answered is not None:
            return list(self.answered)
        if self.who.peer_keys is not None:
            valid, refused = identity.survivor_signers(self.who.peer_keys, self.context, request.survivors, signatures)
            quorum = self.params.quorum(self.round_size)
            if len(valid) < quorum:
                why = "; ".join(f"client {c}: {r}" for c, r in refused.items())
                raise SecAggError(
                    f"client {self.id}: {len(valid)} valid signatures over the survivor list "
                    f"{list(request.survivors)}, fewer than {self.params.quorum_text(self.round_size)} — the server "
                    "sent other clients "
                    f"another list, or forwarded forged signatures{f' ({why})' if why else ''}: refused to reveal "
                    "any share"
                )
        survivors = set(request.survivors)
        self.answered = [
            ShareReveal(self.id, v, "seed", index, seed_share) if v in survivors
            else ShareReveal(self.id, v, "key", index, key_share)
            for v, (index, seed_share, key_share) in sorted(self.held.items())
        ]
        return list(self.answered)
