"""Preference pairs from the synthetic arithmetic problems (:mod:`fedllm.data.synthetic`).

Each problem keeps its ``question`` and its worked correct ``answer`` (the chosen answer) and gains a
``rejected`` answer: the same worked solution with a plausible wrong result -- off by a small amount, or the
result of another operation on the same operands -- written in both the solution line and after ``####``, so
that only the arithmetic tells the two apart.
"""

from __future__ import annotations

import random

from fedllm.data.synthetic import OPERATIONS, arith_splits


def wrong_result(category: str, x: int, y: int, rng: random.Random) -> int:
    """A plausible wrong result of ``x <op> y``: another operation's result or an off-by-a-little one."""
    right = OPERATIONS[category].apply(x, y)
    others = {op.apply(x, y) for name, op in OPERATIONS.items() if name != category and name != "div"}
    candidates = sorted(v for v in others if v != right and v >= 0)
    if candidates and rng.random() < 0.3:
        return rng.choice(candidates)
    off = rng.choice([d for d in range(-10, 11) if d and right + d >= 0])
    return right + off


def preference_pair(problem: dict, rng: random.Random) -> dict:
    """``problem`` with a ``rejected`` answer (see the module docstring)."""
    solution, final = problem["answer"].rsplit("\n#### ", 1)
    head, equation = solution.rsplit(" = ", 1)
    right = int(final)
    operands = head.split()[-3:]  # "x <op> y"
    x, y = int(operands[0]), int(operands[2])
    wrong = wrong_result(problem["category"], x, y, rng)
    rest = equation[len(str(right)) :]
    return {**problem, "rejected": f"{head} = {wrong}{rest}\n#### {wrong}"}


def arith_preference_splits(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Train and test preference pairs (``question``, ``answer`` = chosen, ``rejected``, ``category``)."""
    rng = random.Random(seed + 7)
    train, test = arith_splits(n_train, n_test, seed)
    return [preference_pair(p, rng) for p in train], [preference_pair(p, rng) for p in test]
