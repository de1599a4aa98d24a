"""What a recipe implies alike on every process: the seeds derived from its seed, a client's steps per round.

The engine, the strategies and privacy all derive from these, so an in-process run, N processes and a Flower
federation draw the same numbers.
"""

from __future__ import annotations

import math

from fedllm.recipe.schema import TrainConfig


def derived_seed(*parts: int) -> int:
    """A stable 63-bit seed from integers (seed, round, client ...), for streams nobody's privacy rests on (data
    order, dropout, initialisation): it keeps the low 48 bits of each part and seeds a Mersenne Twister, so it is
    enumerable. Secret streams (DP noise, the secret client sample, DP-SGD's draws) come from
    :mod:`fedllm.privacy.secret_streams` (ChaCha20 keyed by a 256-bit secret)."""
    h = 1469598103934665603
    for p in parts:
        h = ((h ^ (int(p) & 0xFFFFFFFFFFFF)) * 1099511628211) % (1 << 63)
    return h


def steps_per_round(cfg: TrainConfig, num_examples: int) -> int:
    """Optimizer steps a client takes per round (``local_steps``, or ``local_epochs`` passes)."""
    if cfg.local_steps is not None:
        return cfg.local_steps
    per_step = cfg.batch_size * cfg.grad_accum
    return max(1, math.ceil(cfg.local_epochs * num_examples / per_step))
