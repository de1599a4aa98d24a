"""Package attributes imported on first use (PEP 562), so that ``import fedllm.x`` stays light.

A package ``__init__`` that re-exports names from heavy modules (torch, transformers)
declares them here instead of importing them, e.g.::

    __getattr__ = lazy_attributes(__name__, {"evaluate": "fedllm.evaluation.runner"})
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_attributes(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``where[name]`` on first access and caches the value."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
