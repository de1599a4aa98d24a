"""The random streams a privacy guarantee rests on, expanded from a 256-bit secret by ChaCha20.

Central DP's noise and its secret client sample, and DP-SGD's Poisson draws and noise, are only private while
nobody can replay them: a seed an attacker can enumerate (a 48- or 63-bit integer seeding a Mersenne Twister) lets
whoever holds two released models grind it and subtract the noise. Every such stream here is the ChaCha20
keystream (:func:`fedllm.privacy.secagg.masks.expand`, the SecAgg+ masks' generator, ``cryptography``'s OpenSSL
binding) under a key derived from the whole secret and the stream's name by HMAC-SHA256 (:func:`stream_key`):
secrets that differ in any bit give unrelated streams, and a stream of round ``t`` is recomputed from the secret
and ``t`` alone, so a resumed run draws what the uninterrupted one drew.

- :func:`gaussian`: ``N(0, std²)`` by the Box-Muller transform of 53-bit uniforms (tails to 8.5σ), vectorised in
  chunks on torch's intra-op threads (a 7B-element tensor needs no more than each thread's chunk temporaries
  besides its output). Bit-exact from the
  same key on one machine; float64 ``log``/``cos``/``sin`` may differ in the last bit between CPU types (as torch's
  own ``normal`` may), which the rounding to float32 hides but for rare ties;
- :func:`uniforms`, :func:`bernoulli`: 53-bit uniforms on ``[0, 1)``, and independent coins of a rate;
- :func:`subset`: ``k`` of ``n`` items without replacement (the order of ``n`` 64-bit ChaCha20 words).

Streams nobody's privacy rests on (data order, dropout masks, LoRA init) keep the recipe's seeded torch
generators (:func:`fedllm.recipe.schedule.derived_seed`).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedllm.privacy.secagg.masks import SEED_BYTES, expand

SECRET_BYTES = SEED_BYTES
"""Length of a secret and of a stream key (ChaCha20's 256-bit key)."""
CHUNK = 1 << 22
"""Normals drawn per vectorised step of :func:`gaussian` (64 MiB of float64 temporaries)."""


def new_secret() -> bytes:
    """32 bytes from the operating system's randomness, the same in every process of a torch.distributed run."""
    secret = os.urandom(SECRET_BYTES)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [secret]
        dist.broadcast_object_list(box, src=0)
        secret = box[0]
    return secret


def secret_of_seed(seed: int) -> bytes:
    """The secret ``privacy.noise_seed: seed`` stands for (SHA-256 of the whole integer: as public as the seed)."""
    return hashlib.sha256(b"fedllm/noise_seed/" + str(int(seed)).encode()).digest()


def stream_key(secret: bytes, purpose: str, *parts: int | str) -> bytes:
    """The ChaCha20 key of one stream: HMAC-SHA256 keyed by ``secret`` over ``purpose`` and ``parts`` (round,
    client, step, tensor name ...), each length-prefixed so that no two lists of parts encode alike."""
    if len(secret) != SECRET_BYTES:
        raise ValueError(f"a secret has {SECRET_BYTES} bytes, got {len(secret)}")
    message = b"".join(struct.pack("<Q", len(b)) + b for b in
                       (p.encode() if isinstance(p, str) else str(int(p)).encode() for p in (purpose, *parts)))
    return hmac.new(secret, message, hashlib.sha256).digest()


def uniforms(key: bytes, n: int) -> np.ndarray:
    """``n`` uniforms on ``[0, 1)`` with 53 random bits each (float64), the first ``n`` of the key's stream."""
    return (expand(key, n, np.uint64) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def bernoulli(key: bytes, n: int, rate: float) -> np.ndarray:
    """``n`` independent booleans, each True with probability ``rate`` (to 2⁻⁵³)."""
    return uniforms(key, n) < rate


def subset(key: bytes, n: int, k: int) -> list[int]:
    """``k`` of ``range(n)`` uniformly without replacement, in draw order: the ``n`` items ordered by a 64-bit word
    each (two equal words, probability below ``n²/2⁶⁵``, keep index order)."""
    words = expand(key, n, np.uint64)
    return np.argsort(words, kind="stable")[:k].tolist()


def _normals(key: bytes, start: int, count: int, std: float, out: np.ndarray) -> None:
    """Normals ``start .. start + count`` of the key's stream into ``out[start:start + count]`` (``start`` even): the
    keystream read from its block ``start·8/64`` on (ChaCha20's 32-bit block counter, the IV's first 4 bytes)."""
    pairs = (count + 1) // 2
    block, rest = divmod(8 * start, 64)
    stream = Cipher(algorithms.ChaCha20(key, struct.pack("<I", block) + bytes(12)), mode=None).encryptor()
    words = np.frombuffer(stream.update(bytes(rest + 16 * pairs))[rest:], dtype="<u8")
    top = (words >> np.uint64(11)).astype(np.float64).reshape(pairs, 2)  # 53 bits: exact in float64
    radius, angle = top[:, 0], top[:, 1]
    radius += 1.0
    radius *= 2.0**-53  # u₁ ∈ (0, 1]: log defined
    np.log(radius, out=radius)
    radius *= -2.0
    np.sqrt(radius, out=radius)
    radius *= std
    angle *= 2.0**-53 * 2 * math.pi
    normals = np.empty((pairs, 2))
    np.cos(angle, out=normals[:, 0])
    np.sin(angle, out=normals[:, 1])
    normals *= radius[:, None]
    out[start:start + count] = normals.reshape(-1)[:count]


def gaussian(key: bytes, shape: tuple[int, ...] | torch.Size, std: float = 1.0) -> torch.Tensor:
    """``N(0, std²)`` noise of ``shape`` (float32, CPU) from the key's stream, exactly reproducible from ``key``.

    Box-Muller: each pair of 64-bit words gives ``u₁ ∈ (0, 1]`` and ``u₂ ∈ [0, 1)`` (53 bits each) and the two
    independent normals ``std·√(−2 ln u₁)·(cos 2πu₂, sin 2πu₂)``, computed in float64 (numpy's vectorised loops)
    and rounded once to float32. ``CHUNK`` normals at a time, the chunks on torch's intra-op threads (numpy and
    OpenSSL release the GIL), each reading its own stretch of the one keystream: the values do not depend on the
    chunking or the threads, and the first ``m`` values of a longer draw are the ``m``-value draw (for even ``m``)."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    out = np.zeros(numel, dtype=np.float32)
    if std == 0 or numel == 0:
        return torch.from_numpy(out).reshape(shape)
    if len(key) != SECRET_BYTES:
        raise ValueError(f"a stream key has {SECRET_BYTES} bytes, got {len(key)}")
    if 8 * (numel + 1) > 64 << 32:
        raise ValueError(f"{numel} normals exceed one ChaCha20 stream (2^32 blocks of 64 bytes)")
    starts = range(0, numel, CHUNK)
    workers = min(len(starts), torch.get_num_threads())
    if workers <= 1:
        for start in starts:
            _normals(key, start, min(CHUNK, numel - start), std, out)
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda start: _normals(key, start, min(CHUNK, numel - start), std, out), starts))
    return torch.from_numpy(out).reshape(shape)
