"""Preference-pair fixtures shared by the preference tests (``pytest -k preference``)."""

import random


def preference_records(n: int, seed: int = 0) -> list[dict]:
    """Arithmetic preference pairs: the correct sum chosen, an off-by-one-or-two sum rejected."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        wrong = a + b + rng.choice([-2, -1, 1, 2])
        out.append(
            {"prompt": f"What is {a} + {b}?", "chosen": f"{a} + {b} = {a + b}", "rejected": f"{a} + {b} = {wrong}"}
        )
    return out
