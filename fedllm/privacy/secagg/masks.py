"""Masks: uniform integers modulo ``2^mod_bits`` expanded from a 256-bit seed by the ChaCha20 stream cipher.

ChaCha20's keystream (``cryptography``'s OpenSSL binding) is a cryptographic pseudorandom generator: without the
seed the mask is indistinguishable from uniform, and the seed space is 2^256 (Flower's SecAgg+ folds its seed to
32 bits for numpy's MT19937; this module never does). Each 32- or 64-bit word of the stream is one value: every
residue modulo ``2^mod_bits`` equally likely.
"""

from __future__ import annotations

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

SEED_BYTES = 32
_NONCE = bytes(16)  # each seed expands one mask only, so a fixed nonce (counter 0) is safe


def expand(seed: bytes, size: int, dtype: np.dtype) -> np.ndarray:
    """``size`` uniform words of ``dtype`` (uint32/uint64) from the 32-byte ``seed``."""
    if len(seed) != SEED_BYTES:
        raise ValueError(f"a mask seed has {SEED_BYTES} bytes, got {len(seed)}")
    dtype = np.dtype(dtype)
    stream = Cipher(algorithms.ChaCha20(seed, _NONCE), mode=None).encryptor().update(bytes(size * dtype.itemsize))
    return np.frombuffer(stream, dtype=dtype.newbyteorder("<")).astype(dtype)
