"""A client's SecAgg+ public keys bound to its authenticated identity: signed with its node key.

In a deployment every client's node holds a key pair registered for that client id (``fedllm flower certs``: ECDSA
P-384, OpenSSH files ``client-K.key`` / ``client-K.pub``). A client signs the two X25519 public keys it advertises
(with the round's context and its id) with its node key; every neighbour verifies the signature against the
registered public key of the advertised client, read from its own copy of the node public keys, before it encrypts
a share or agrees a mask with those keys. A server that substitutes its own keys for a client's (to sit in the middle
of the share exchange and read the shares) is then refused: it cannot sign for any client (Bell et al., CCS 2020,
§3.1 and Bonawitz et al., CCS 2017, §6: a PKI makes the protocol secure against a server that forges messages).
Signatures: ECDSA with SHA-384 from ``cryptography``.

The same keys sign the survivor list of the consistency check (Bonawitz et al., CCS 2017, §4, the actively secure
protocol's ConsistencyCheck round; :meth:`fedllm.privacy.secagg.SecAggClient.check`): a client reveals shares only
for a list that a quorum of registered clients signed, so a server cannot tell some clients that a client dropped
and others that it survived. In simulation there are no node keys: :func:`simulated` makes a key pair per simulated
client and hands every client the public ones directly (the registration a deployment does out of band).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedllm.privacy.secagg.messages import KeyAdvert
from fedllm.privacy.secagg.params import SecAggError

_ALGORITHM = ec.ECDSA(hashes.SHA384())


def signed_bytes(context: bytes, advert: KeyAdvert) -> bytes:
    """What a client signs: the purpose, the round's context, its id and both public keys."""
    return (b"fedllm-secagg/advert/" + context + struct.pack("<q", advert.client_id) + advert.encryption_key
            + advert.masking_key)


def load_signing_key(path: str | Path) -> ec.EllipticCurvePrivateKey:
    """A node's private key (OpenSSH or PEM file)."""
    data = Path(path).read_bytes()
    try:
        return serialization.load_ssh_private_key(data, password=None)
    except ValueError:
        return serialization.load_pem_private_key(data, password=None)


def load_peer_keys(directory: str | Path) -> dict[int, ec.EllipticCurvePublicKey]:
    """Client id -> its node's registered public key, from the ``client-K.pub`` files (OpenSSH) of ``directory``."""
    keys = {}
    for path in sorted(Path(directory).glob("client-*.pub")):
        keys[int(path.stem.split("-", 1)[1])] = serialization.load_ssh_public_key(path.read_bytes())
    if not keys:
        raise SecAggError(f"{directory}: no node public keys (client-K.pub) to verify the SecAgg+ keys against")
    return keys


def sign(key: ec.EllipticCurvePrivateKey, context: bytes, advert: KeyAdvert) -> bytes:
    """The DER signature of ``advert`` in the round named ``context``."""
    return key.sign(signed_bytes(context, advert), _ALGORITHM)


def verify(peer_keys: dict[int, ec.EllipticCurvePublicKey], context: bytes, advert: KeyAdvert,
           signature: bytes) -> None:
    """Raise :class:`SecAggError` unless ``signature`` is client ``advert.client_id``'s over ``advert``."""
    _verify(peer_keys, advert.client_id, signed_bytes(context, advert), signature, "SecAgg+ keys", "are")


def encryption_key_bytes(client_id: int, encryption_key: bytes) -> bytes:
    """What a Flower node signs once per run and worker: its client id and the X25519 public key its neighbours
    encrypt their shares to (the private half stays in the worker's memory and is never revealed, so a signed key
    is safe to encrypt to in any round; a stale one only makes the shares unreadable to the node itself)."""
    return b"fedllm-secagg/encryption-key/" + struct.pack("<q", client_id) + encryption_key


def sign_encryption_key(key: ec.EllipticCurvePrivateKey, client_id: int, encryption_key: bytes) -> bytes:
    """The DER signature of a node's long-lived encryption key (:func:`encryption_key_bytes`)."""
    return key.sign(encryption_key_bytes(client_id, encryption_key), _ALGORITHM)


def verify_encryption_key(peer_keys: dict[int, ec.EllipticCurvePublicKey], client_id: int, encryption_key: bytes,
                          signature: bytes) -> None:
    """Raise :class:`SecAggError` unless ``signature`` is ``client_id``'s registered node key's over the key."""
    _verify(peer_keys, client_id, encryption_key_bytes(client_id, encryption_key), signature,
            "SecAgg+ encryption key", "is")


def _verify(peer_keys: dict[int, ec.EllipticCurvePublicKey], client_id: int, message: bytes, signature: bytes,
            what: str, verb: str) -> None:
    public = peer_keys.get(client_id)
    if public is None:
        raise SecAggError(f"client {client_id}'s {what}: no registered node key for that client")
    try:
        public.verify(signature, message, _ALGORITHM)
    except InvalidSignature:
        raise SecAggError(f"client {client_id}'s {what} {verb} not signed by its registered node key "
                          "(substituted in transit?): refused") from None


@dataclass(frozen=True)
class Identity:
    """What a client signs with and verifies against: its own key (``None``: it cannot sign, e.g. a Flower node
    without ``--auth-key``) and the registered public keys of the round's clients (``None``: it cannot verify)."""

    signing_key: ec.EllipticCurvePrivateKey | None = None
    peer_keys: dict[int, ec.EllipticCurvePublicKey] | None = None


def simulated(client_ids: list[int], exchange=list) -> tuple[dict[int, Identity], dict[int, ec.EllipticCurvePublicKey]]:
    """Fresh ECDSA P-384 key pairs for the simulated clients ``client_ids`` of this process: each client's identity
    (its private key, every client's public key) and the public keys of all. ``exchange``: every process's list,
    concatenated (N processes). A simulation of the registration a deployment does with ``fedllm flower certs``: the
    public keys travel between the processes directly, never through the simulated server."""
    private = {c: ec.generate_private_key(ec.SECP384R1()) for c in client_ids}
    rows = exchange([(c, k.public_key().public_bytes(serialization.Encoding.DER,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
                     for c, k in private.items()])
    public = {c: serialization.load_der_public_key(der) for c, der in rows}
    return {c: Identity(k, public) for c, k in private.items()}, public


def survivors_bytes(context: bytes, survivors: tuple[int, ...]) -> bytes:
    """What a client signs in the consistency check: the purpose, the round's context and the sorted survivor ids."""
    ids = sorted(survivors)
    return b"fedllm-secagg/survivors/" + context + struct.pack(f"<q{len(ids)}q", len(ids), *ids)


def sign_survivors(key: ec.EllipticCurvePrivateKey, context: bytes, survivors: tuple[int, ...]) -> bytes:
    """The DER signature of the survivor list ``survivors`` (``U3``) of the round named ``context``."""
    return key.sign(survivors_bytes(context, survivors), _ALGORITHM)


def survivor_signers(peer_keys: dict[int, ec.EllipticCurvePublicKey], context: bytes, survivors: tuple[int, ...],
                     signatures: dict[int, bytes]) -> tuple[list[int], dict[int, str]]:
    """The survivors whose signature over exactly ``survivors`` in this round verifies with their registered key,
    and why each other signature was not counted."""
    message, valid, refused = survivors_bytes(context, survivors), [], {}
    for cid, signature in sorted(signatures.items()):
        public = peer_keys.get(cid)
        if cid not in survivors:
            refused[cid] = "not among the survivors"
        elif public is None:
            refused[cid] = "no registered node key"
        else:
            try:
                public.verify(signature, message, _ALGORITHM)
                valid.append(cid)
            except InvalidSignature:
                refused[cid] = "its signature is not over this survivor list and round with its registered key"
    return valid, refused
