"""Strict JSON for the files fedllm writes: a non-finite float becomes ``null``, never a bare ``NaN``; credentials
are masked (:mod:`fedllm.common.redact`)."""

from __future__ import annotations

import json
import math
from typing import Any


def finite_or_none(value: Any) -> Any:
    """``value`` with every nan/inf float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def dumps(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` that writes standard JSON only (``allow_nan=False`` after :func:`finite_or_none`), with
    credentials masked by :func:`fedllm.common.redact.redact`."""
    from fedllm.common.redact import redact

    return json.dumps(redact(finite_or_none(value)), allow_nan=False, **kwargs)
