"""Synthetic arithmetic word problems: deterministic, correct, GSM8K-shaped."""

from __future__ import annotations

import operator
import re
from collections import Counter

import pytest

from fedllm.data.synthetic import OPERATIONS, arith_splits, generate_arith

OPS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "div": operator.truediv}


def final_answer(answer: str) -> str:
    last = answer.strip().splitlines()[-1]
    assert last.startswith("#### ")
    return last[len("#### "):]


def test_deterministic():
    assert generate_arith(50, seed=3) == generate_arith(50, seed=3)
    assert generate_arith(50, seed=3) != generate_arith(50, seed=4)


def test_answers_are_correct_and_small():
    problems = generate_arith(400, seed=0)
    for p in problems:
        x, y = (int(v) for v in re.findall(r"\d+", p["question"]))
        expected = OPS[p["category"]](x, y)
        assert float(final_answer(p["answer"])) == expected and expected == int(expected) and expected > 0
        assert x < 100 and y < 100
        assert f"{x} {OPERATIONS[p['category']].symbol} {y} = {int(expected)}" in p["answer"]
    assert Counter(p["category"] for p in problems) == {"add": 100, "sub": 100, "mul": 100, "div": 100}
    assert len({p["question"] for p in problems}) == 400


def test_splits_do_not_overlap():
    train, test = arith_splits(300, 60, seed=1)
    assert len(train) == 300 and len(test) == 60
    assert not {p["question"] for p in train} & {p["question"] for p in test}


def test_unknown_category():
    with pytest.raises(ValueError, match="unknown arithmetic"):
        generate_arith(3, categories=("pow",))
