"""Errors of ``fedllm export``: bad input (exit code 2) and a failed self-check (exit code 1)."""

from __future__ import annotations

from fedllm.common.errors import InputError


class ExportInputError(InputError):
    """The export cannot be done as asked: a torn or foreign source, a bad option, an impossible rank."""


class ExportCheckError(RuntimeError):
    """An exact export does not reproduce the run's model on the probe input (a bug, not bad input)."""
