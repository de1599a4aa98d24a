"""Length-grouped micro-batches: a permutation per pass, seeded, and less padding than plain shuffling."""

import torch

from fedllm.data.length_grouping import LengthGroupedStream, padded_positions
from fedllm.engine.client import BatchStream


def _padding(stream, lengths: dict[int, int], batches: int) -> float:
    padded = total = 0
    for _ in range(batches):
        b = [lengths[i] for i in stream.next()]
        padded += sum(max(b) - n for n in b)
        total += max(b) * len(b)
    return padded / total


def test_each_pass_is_a_permutation_and_the_seed_fixes_it():
    indices = list(range(100, 137))
    lengths = [(7 * i) % 23 + 1 for i in range(37)]
    stream = LengthGroupedStream(indices, lengths, batch_size=4, seed=3, mega=2)
    first = [stream.next() for _ in range(10)]  # 37 examples = 9 batches of 4 + one of 1
    assert sorted(i for b in first for i in b) == indices
    assert [len(b) for b in first].count(1) == 1
    again = LengthGroupedStream(indices, lengths, batch_size=4, seed=3, mega=2)
    assert [again.next() for _ in range(10)] == first
    other = LengthGroupedStream(indices, lengths, batch_size=4, seed=4, mega=2)
    assert [other.next() for _ in range(10)] != first


def test_batches_within_a_window_are_sorted_by_length():
    """With one window covering the whole client, batch k holds the k-th group of 4 of the sorted lengths."""
    lengths = [5, 1, 9, 3, 7, 2, 8, 4]
    stream = LengthGroupedStream(list(range(8)), lengths, batch_size=4, seed=0)
    batches = sorted((sorted(lengths[i] for i in stream.next()) for _ in range(2)), key=max)
    assert batches == [[1, 2, 3, 4], [5, 7, 8, 9]]


def test_grouping_reduces_padding():
    gen = torch.Generator().manual_seed(0)
    lengths = {i: int(n) for i, n in enumerate(torch.randint(5, 200, (400,), generator=gen))}
    plain = _padding(BatchStream(list(lengths), 4, seed=1), lengths, 100)
    grouped = _padding(LengthGroupedStream(list(lengths), list(lengths.values()), 4, seed=1), lengths, 100)
    assert plain > 0.25 and grouped < 0.05


def test_padded_positions_of_a_mask():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    assert padded_positions(mask) == (5, 12)
