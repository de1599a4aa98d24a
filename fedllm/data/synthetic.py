"""A synthetic GSM8K-format data set of one-step arithmetic word problems.

Records are ``{"question", "answer", "category"}``: ``answer`` is a one-line
worked solution followed by ``#### <number>`` on the last line, as in GSM8K, and
``category`` is the operation (``add``, ``sub``, ``mul``, ``div``), a natural
label for skewed partitions. Every question names its two operands in order,
``x`` then ``y``, and the answer is ``x <op> y`` (division is exact). Operands
have one or two digits so that a small model can learn the format.
"""

from __future__ import annotations

import operator
import random
from dataclasses import dataclass
from typing import Callable

NAMES = ("Tom", "Anna", "Liam", "Mia", "Noah", "Emma", "Leo", "Sara", "Ben", "Zoe", "Omar", "Lily")
ITEMS = ("apples", "pencils", "marbles", "cookies", "stickers", "books", "oranges", "cards", "flowers", "coins")


@dataclass(frozen=True)
class Operation:
    """One arithmetic operation and its word-problem templates.

    Attributes:
        symbol: Operator written in the worked solution.
        apply: ``apply(x, y)`` -> the answer.
        draw: ``draw(rng)`` -> operands ``(x, y)``.
        templates: ``(question, solution)`` pairs with ``{name}``, ``{item}``,
            ``{x}``, ``{y}`` and (solution only) ``{r}`` slots.
    """

    symbol: str
    apply: Callable[[int, int], int]
    draw: Callable[[random.Random], tuple[int, int]]
    templates: tuple[tuple[str, str], ...]


def _draw_sub(rng: random.Random) -> tuple[int, int]:
    x = rng.randint(10, 99)
    return x, rng.randint(1, x - 1)


def _draw_div(rng: random.Random) -> tuple[int, int]:
    y = rng.randint(2, 9)
    return y * rng.randint(2, 12), y


#: Category -> operation.
OPERATIONS: dict[str, Operation] = {
    "add": Operation("+", operator.add, lambda rng: (rng.randint(1, 99), rng.randint(1, 99)), (
        ("{name} has {x} {item} and buys {y} more. How many {item} does {name} have now?",
         "{name} has {x} + {y} = {r} {item} now."),
        ("There are {x} {item} in a basket. {name} puts in {y} more. How many {item} are in the basket now?",
         "The basket has {x} + {y} = {r} {item} now."),
        ("{name} picked {x} {item} in the morning and {y} {item} in the afternoon. "
         "How many {item} did {name} pick in total?",
         "{name} picked {x} + {y} = {r} {item} in total."),
    )),
    "sub": Operation("-", operator.sub, _draw_sub, (
        ("{name} has {x} {item} and gives {y} to a friend. How many {item} does {name} have left?",
         "{name} has {x} - {y} = {r} {item} left."),
        ("A shop has {x} {item}. It sells {y} of them. How many {item} are left in the shop?",
         "The shop has {x} - {y} = {r} {item} left."),
        ("{name} had {x} {item} and lost {y} of them. How many {item} does {name} have now?",
         "{name} has {x} - {y} = {r} {item} now."),
    )),
    "mul": Operation("*", operator.mul, lambda rng: (rng.randint(2, 12), rng.randint(2, 12)), (
        ("{name} buys {x} boxes with {y} {item} in each box. How many {item} does {name} buy in total?",
         "{name} buys {x} * {y} = {r} {item}."),
        ("There are {x} bags and each bag holds {y} {item}. How many {item} are there altogether?",
         "There are {x} * {y} = {r} {item} altogether."),
        ("{name} gets {x} {item} every day for {y} days. How many {item} does {name} get in total?",
         "{name} gets {x} * {y} = {r} {item} in total."),
    )),
    "div": Operation("/", operator.floordiv, _draw_div, (
        ("{name} shares {x} {item} equally among {y} friends. How many {item} does each friend get?",
         "Each friend gets {x} / {y} = {r} {item}."),
        ("{name} packs {x} {item} into bags of {y}. How many bags does {name} fill?",
         "{name} fills {x} / {y} = {r} bags."),
        ("{name} has {x} {item} and puts them into {y} equal groups. How many {item} are in each group?",
         "Each group has {x} / {y} = {r} {item}."),
    )),
}


def make_problem(rng: random.Random, category: str) -> dict:
    """One word problem of ``category``.

    Args:
        rng: Source of randomness.
        category: A key of :data:`OPERATIONS`.

    Returns:
        ``{"question", "answer", "category"}``; the answer ends with ``#### <number>``.
    """
    op = OPERATIONS[category]
    x, y = op.draw(rng)
    question, solution = rng.choice(op.templates)
    slots = {"name": rng.choice(NAMES), "item": rng.choice(ITEMS), "x": x, "y": y, "r": op.apply(x, y)}
    return {
        "question": question.format(**slots),
        "answer": f"{solution.format(**slots)}\n#### {slots['r']}",
        "category": category,
    }


def generate_arith(n: int, seed: int = 0, categories: tuple[str, ...] = tuple(OPERATIONS), exclude: frozenset[str] = frozenset()) -> list[dict]:
    """``n`` distinct problems, cycling through ``categories`` (balanced classes).

    Args:
        n: Number of problems.
        seed: Seed; equal seeds give equal data sets.
        categories: Operations to draw, in turn.
        exclude: Questions not to produce (e.g. the training questions).

    Returns:
        The problems.

    Raises:
        ValueError: Unknown category, or not enough distinct questions.
    """
    unknown = set(categories) - set(OPERATIONS)
    if unknown or not categories:
        raise ValueError(f"unknown arithmetic categories {sorted(unknown)}; known: {', '.join(OPERATIONS)}")
    rng = random.Random(seed)
    seen = set(exclude)
    problems: list[dict] = []
    for _ in range(50 * n + 100):
        if len(problems) == n:
            break
        problem = make_problem(rng, categories[len(problems) % len(categories)])
        if problem["question"] not in seen:
            seen.add(problem["question"])
            problems.append(problem)
    if len(problems) < n:
        raise ValueError(f"could only draw {len(problems)} distinct problems of the {n} asked")
    return problems


def arith_splits(n_train: int, n_test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """A train and a test split with no question in common.

    Args:
        n_train: Training problems.
        n_test: Test problems.
        seed: Seed of both splits.

    Returns:
        ``(train, test)``.
    """
    train = generate_arith(n_train, seed)
    test = generate_arith(n_test, seed + 1_000_003, exclude=frozenset(p["question"] for p in train))
    return train, test
