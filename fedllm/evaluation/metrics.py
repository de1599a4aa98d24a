"""Aggregate metrics over per-example scores."""

from __future__ import annotations

from typing import Sequence


def accuracy(correct: Sequence[bool]) -> float:
    """Fraction of true entries (0.0 for an empty sequence)."""
    return sum(bool(c) for c in correct) / len(correct) if correct else 0.0


def matthews_corrcoef(labels: Sequence[int], predictions: Sequence[int]) -> float:
    """Matthews correlation coefficient (scikit-learn's implementation)."""
    from sklearn.metrics import matthews_corrcoef as mcc

    return float(mcc(list(labels), list(predictions)))


def mean_rating(ratings: Sequence[float], unparsed_as_minus_one: bool = False) -> float:
    """Mean of the valid judge ratings (``-1`` marks an unparseable judgment); NaN if none is valid.

    ``unparsed_as_minus_one``: average the unparsed ones in as -1 (OpenFedLLM's ``show_results_vicuna.py``:
    ``np.mean`` over every score, -1 included); NaN only for no ratings at all.
    """
    valid = list(ratings) if unparsed_as_minus_one else [r for r in ratings if r >= 0]
    return sum(valid) / len(valid) if valid else float("nan")
