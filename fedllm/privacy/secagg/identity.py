"""A client's SecAgg+ public keys bound to its authenticated identity: signed with its node key.

In a deployment every client's node holds a key pair registered for that client id (``fedllm flower certs``: ECDSA
P-384, OpenSSH files ``client-K.key`` / ``client-K.pub``). A client signs the two X25519 public keys it advertises
(with the round's context and its id) with its node key; every neighbour verifies the signature against the
registered public key of the advertised client, read from its own copy of the node public keys, before it encrypts
a share or agrees a mask with those keys. A server that substitutes its own keys for a client's (to sit in the middle
of the share exchange and read the shares) is then refused: it cannot sign for any client (Bell et al., CCS 2020,
§3.1 and Bonawitz et al., CCS 2017, §6: a PKI makes the protocol secure against a server that forges messages).
Signatures: ECDSA with SHA-384 from ``cryptography``.
"""

from __future__ import annotations

import struct
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
    public = peer_keys.get(advert.client_id)
    if public is None:
        raise SecAggError(f"client {advert.client_id}'s SecAgg+ keys: no registered node key for that client")
    try:
        public.verify(signature, signed_bytes(context, advert), _ALGORITHM)
    except InvalidSignature:
        raise SecAggError(f"client {advert.client_id}'s SecAgg+ keys are not signed by its registered node key "
                          "(substituted in transit?): refused") from None
