"""The primitives of SecAgg+, all from maintained libraries (none written here):

- X25519 key pairs and Diffie-Hellman agreement (``cryptography``);
- HKDF-SHA256 to turn an agreed secret into a key bound to the round and the pair (``cryptography``);
- ChaCha20-Poly1305 authenticated encryption of the shares (``cryptography``);
- Shamir secret sharing over GF(2^128) (``pycryptodome``'s ``Crypto.Protocol.SecretSharing.Shamir``), applied to
  each 16-byte half of a 32-byte secret.
"""

from __future__ import annotations

import os

from Crypto.Protocol.SecretSharing import Shamir
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_RAW = {"encoding": serialization.Encoding.Raw}
NONCE_BYTES = 12
CHUNK = 16  # pycryptodome's Shamir shares 16-byte secrets


def new_key_pair() -> tuple[X25519PrivateKey, bytes]:
    """A fresh X25519 private key and its 32-byte raw public key."""
    return public_of(X25519PrivateKey.generate())


def public_of(sk: X25519PrivateKey) -> tuple[X25519PrivateKey, bytes]:
    """``sk`` and its raw public key (to check a rebuilt private key against the advertised public one)."""
    return sk, sk.public_key().public_bytes(format=serialization.PublicFormat.Raw, **_RAW)


def private_bytes(sk: X25519PrivateKey) -> bytes:
    """The 32 raw bytes of a private key (what is secret-shared)."""
    return sk.private_bytes(
        format=serialization.PrivateFormat.Raw, encryption_algorithm=serialization.NoEncryption(), **_RAW
    )


def private_key(raw: bytes) -> X25519PrivateKey:
    """A private key from its 32 raw bytes."""
    return X25519PrivateKey.from_private_bytes(raw)


def agree(sk: X25519PrivateKey, peer_public: bytes, info: bytes) -> bytes:
    """A 32-byte key both ends derive: HKDF-SHA256 of the X25519 secret, bound to ``info`` (round, purpose, pair)."""
    shared = sk.exchange(X25519PublicKey.from_public_bytes(peer_public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def encrypt(key: bytes, plaintext: bytes, associated: bytes) -> bytes:
    """``nonce ‖ ChaCha20-Poly1305(plaintext)`` authenticated together with ``associated``."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, associated)


def decrypt(key: bytes, sealed: bytes, associated: bytes) -> bytes:
    """Inverse of :func:`encrypt`; raises ``cryptography.exceptions.InvalidTag`` on any tampering."""
    return ChaCha20Poly1305(key).decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], associated)


def split(secret: bytes, threshold: int, count: int) -> list[bytes]:
    """``count`` Shamir shares of ``secret`` (a multiple of 16 bytes), any ``threshold`` of which rebuild it.

    Share ``i`` (0-based) is the concatenation of the ``(i+1)``-th share of every 16-byte chunk; its Shamir index
    is ``i + 1``.
    """
    if len(secret) % CHUNK:
        raise ValueError(f"a shared secret is a multiple of {CHUNK} bytes, got {len(secret)}")
    chunks = [Shamir.split(threshold, count, secret[i : i + CHUNK]) for i in range(0, len(secret), CHUNK)]
    return [b"".join(chunk[i][1] for chunk in chunks) for i in range(count)]


def combine(shares: dict[int, bytes]) -> bytes:
    """The secret from exactly ``threshold`` shares ``{Shamir index: share}`` (see :func:`split`)."""
    length = len(next(iter(shares.values())))
    return b"".join(
        Shamir.combine([(idx, s[i : i + CHUNK]) for idx, s in sorted(shares.items())]) for i in range(0, length, CHUNK)
    )
