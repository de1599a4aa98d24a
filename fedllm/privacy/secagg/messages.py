"""The messages of a SecAgg+ round: plain data (ints, bytes, numpy arrays), so a transport can carry them as they
are (torch.distributed's object collectives, Flower's records: bytes and arrays map one to one)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KeyAdvert:
    """Stage 1, client → server → neighbours: a client's two X25519 public keys (32 bytes each)."""

    client_id: int
    encryption_key: bytes  # c_u^PK: agreed with a neighbour's to encrypt the shares sent to it
    masking_key: bytes  # s_u^PK: agreed with a neighbour's to seed the pairwise mask


@dataclass(frozen=True)
class EncryptedShare:
    """Stage 2, client → server → one neighbour: the sender's shares of its self-mask seed and masking key,
    encrypted for the receiver (the server routes it and cannot read it)."""

    sender: int
    receiver: int
    sealed: bytes  # nonce ‖ ChaCha20-Poly1305 ciphertext ‖ tag


@dataclass(frozen=True)
class MaskedInput:
    """Stage 3, client → server: ``y_u = x_u + PRG(b_u) + Σ_v ±PRG(s_uv) mod 2^mod_bits``."""

    client_id: int
    vector: np.ndarray  # uint32 / uint64 words


@dataclass(frozen=True)
class UnmaskRequest:
    """Consistency check and stage 4, server → surviving clients: who sent a masked input (``U3``) and who was lost
    after sharing (``U2 − U3``)."""

    survivors: tuple[int, ...]
    dropped: tuple[int, ...]


@dataclass(frozen=True)
class SurvivorSignature:
    """Consistency check, client → server → every survivor: a survivor's signature over the round's context and the
    survivor list ``U3`` it was sent (Bonawitz et al., CCS 2017, §4, ConsistencyCheck)."""

    client_id: int
    signature: bytes  # DER ECDSA P-384/SHA-384 with its (node) identity key; empty when it has none


@dataclass(frozen=True)
class ShareReveal:
    """Stage 4, client → server: the share a client holds of a neighbour's self-mask seed (the neighbour
    survived) or of its masking key (the neighbour dropped), never both for one neighbour."""

    holder: int
    owner: int
    kind: str  # "seed" (b_owner) or "key" (s_owner^SK)
    index: int  # Shamir index
    share: bytes
