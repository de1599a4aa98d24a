"""Errors raised by :mod:`fedllm.data`."""

from __future__ import annotations

from fedllm.common.errors import InputError


class DataError(InputError):
    """A data set cannot be loaded, formatted or tokenized as the recipe asks."""


class PartitionError(InputError):
    """Records cannot be split into the requested clients."""
