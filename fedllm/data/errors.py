"""Errors raised by :mod:`fedllm.data`."""

from __future__ import annotations


class DataError(ValueError):
    """A data set cannot be loaded, formatted or tokenized as the recipe asks."""


class PartitionError(ValueError):
    """Records cannot be split into the requested clients."""
