"""How fast this machine computes right now: one line for `.ci/run` to print beside the suite's seconds.

The CPU seconds of identical test runs on a shared 2-core machine differ by up to 1.6x from one hour to the
next (the host, not the suite). Two yardsticks taken in the same minutes tell a slower host from a heavier
suite: a float32 matrix product on one thread (torch, as the suite's training) and a pure-Python loop (as
pytest, the data code and Flower's processes). Each is the best of three trials of about half a second.
"""

import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402


def best_rate(trial, trials: int = 3) -> float:
    """Work per CPU-second of the fastest of ``trials`` calls of ``trial`` (which returns its amount of work)."""
    rates = []
    for _ in range(trials):
        start = time.process_time()
        work = trial()
        rates.append(work / (time.process_time() - start))
    return max(rates)


def matmul_flops(n: int = 512, repeat: int = 60) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(repeat):
        a @ b
    return 2.0 * n ** 3 * repeat


def python_loop(count: int = 2_000_000) -> float:
    total = 0
    for i in range(count):
        total += i * i
    return float(count)


if __name__ == "__main__":
    torch.set_num_threads(1)
    matmul_flops(repeat=5)  # warm-up
    print(f"host speed: float32 matmul {best_rate(matmul_flops) / 1e9:.0f} GFLOP/s on one thread, "
          f"Python loop {best_rate(python_loop) / 1e6:.1f} M iterations/s")
