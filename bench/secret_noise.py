"""Gaussian noise from the ChaCha20 secret streams (``fedllm.privacy.secret_streams.gaussian``) against
``torch.normal`` with a seeded Mersenne-Twister generator: seconds per draw of ``--numel`` normals, the two run
interleaved in each trial (order alternating), and the ChaCha20 keystream alone (not a test).

    python bench/secret_noise.py --numel 20000000 --trials 3

Prints per trial the seconds of each and the ratio, then the medians (docs/privacy.md has the figures).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from fedllm.privacy.secret_streams import gaussian, new_secret, stream_key


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=20_000_000, help="normals per draw")
    parser.add_argument("--trials", type=int, default=3, help="interleaved trials")
    opts = parser.parse_args()
    key, gen = stream_key(new_secret(), "bench"), torch.Generator().manual_seed(0)
    draws = {"chacha20": lambda: gaussian(key, (opts.numel,), 1.0),
             "torch.normal": lambda: torch.normal(0.0, 1.0, (opts.numel,), generator=gen),
             "keystream": lambda: Cipher(algorithms.ChaCha20(key, bytes(16)), mode=None).encryptor()
             .update(bytes(8 * opts.numel))}
    rows = []
    for trial in range(opts.trials):
        order = list(draws) if trial % 2 == 0 else list(draws)[::-1]
        row = {name: timed(draws[name]) for name in order}
        rows.append(row)
        print(f"trial {trial}: " + "  ".join(f"{k} {v:.3f}s" for k, v in row.items())
              + f"  chacha20/torch.normal {row['chacha20'] / row['torch.normal']:.2f}")
    med = {k: statistics.median(r[k] for r in rows) for k in draws}
    print("median: " + "  ".join(f"{k} {v:.3f}s" for k, v in med.items())
          + f"  ratio {med['chacha20'] / med['torch.normal']:.2f}  ({torch.get_num_threads()} torch threads)")


if __name__ == "__main__":
    main()
