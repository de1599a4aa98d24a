"""Instruction records whose lengths spread as real instruction data's do (for measuring padding and packing).

Real instruction-tuning sets (Alpaca, alpaca-gpt4, the FedLLM-Bench clients) pair short instructions with answers
from a few words to several hundred: a long-tailed, roughly log-normal spread, under which a right-padded
micro-batch computes mostly padding. :func:`length_spread_records` draws Alpaca-format records (``instruction``,
``input``, ``output``) with log-normal word counts:

- ``instruction``: median :data:`INSTRUCTION_WORDS` words (sigma 0.6);
- ``input``: present in a fraction :data:`INPUT_SHARE` of records, median :data:`INPUT_WORDS` words (sigma 1.0);
- ``output``: median :data:`OUTPUT_WORDS` words (sigma 1.0: a tenth of the answers above ~3.6x the median);

every part at least 2 and at most :data:`MAX_WORDS` words. The words are drawn from a fixed list, so the text means
nothing; only its lengths matter. The same seed gives the same records.
"""

from __future__ import annotations

import math
import random

INSTRUCTION_WORDS, INPUT_WORDS, OUTPUT_WORDS = 14, 25, 60
INPUT_SHARE = 0.4
MAX_WORDS = 600
WORDS = ("the", "a", "model", "answer", "data", "federated", "client", "server", "round", "learning", "rate",
         "explain", "write", "list", "describe", "summarize", "why", "how", "what", "story", "poem", "code", "number",
         "river", "city", "history", "science", "energy", "light", "music", "garden", "market", "health", "travel",
         "language", "question", "example", "simple", "important", "different", "because", "which", "people",
         "time", "world", "water", "system", "process", "value", "result")


def _words(rng: random.Random, median: int, sigma: float) -> str:
    n = min(MAX_WORDS, max(2, round(math.exp(rng.gauss(math.log(median), sigma)))))
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(w + ("." if i % 12 == 11 else "") for i, w in enumerate(words))


def length_spread_records(n: int, seed: int = 0) -> list[dict]:
    """``n`` Alpaca-format records with the long-tailed lengths of the module docstring."""
    rng = random.Random(seed)
    return [{"instruction": _words(rng, INSTRUCTION_WORDS, 0.6),
             "input": _words(rng, INPUT_WORDS, 1.0) if rng.random() < INPUT_SHARE else "",
             "output": _words(rng, OUTPUT_WORDS, 1.0)} for _ in range(n)]
