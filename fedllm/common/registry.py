"""Registries: strategies, tasks, partitioners and model presets are picked by name.

Listing names and validating a recipe must not import torch, so the built-in
registries know their names *without importing the modules that register them*:
each is given the files to read (``scan``), and every ``@register_strategy("name")``
(``register_task``, ``register_partitioner``) written in those files is a known
name whose module is imported on first :meth:`Registry.get`. A new strategy is
therefore picked up by dropping a file with ``@register_strategy("my_algo")`` into
``fedllm/strategies/`` -- nothing else to edit. Names registered at run time by user
code (``register_strategy("x")(MyStrategy)``) work as before.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

from fedllm.common.errors import did_you_mean

T = TypeVar("T")
PACKAGE_DIR = Path(__file__).resolve().parent.parent


class Registry(Generic[T]):
    """A name -> object map filled by decorators, optionally knowing names of modules not yet imported."""

    def __init__(self, kind: str, scan: Optional[tuple[str, str]] = None):
        """``scan = (path under fedllm/, decorator name)``: a package directory or a ``.py`` file to read."""
        self.kind = kind
        self._items: dict[str, T] = {}
        self._scan = scan
        self._lazy: Optional[dict[str, str]] = None

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def lazy_names(self) -> dict[str, str]:
        """``name -> module`` of every registration written in the scanned files (read once, not imported)."""
        if self._lazy is None:
            self._lazy = {}
            if self._scan is not None:
                rel, decorator = self._scan
                where = PACKAGE_DIR / rel
                files = sorted(where.glob("*.py")) if where.is_dir() else [where]
                pattern = re.compile(rf"\b{decorator}\(\s*[\"']([^\"']+)[\"']")
                for file in files:
                    module = ".".join(("fedllm", *file.relative_to(PACKAGE_DIR).with_suffix("").parts))
                    for name in pattern.findall(file.read_text(encoding="utf-8")):
                        self._lazy.setdefault(name, module)
        return self._lazy

    def get(self, name: str) -> T:
        """The object registered as ``name`` (importing its module if needed); KeyError with suggestions otherwise."""
        if name not in self._items and name in self.lazy_names():
            importlib.import_module(self.lazy_names()[name])
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}{did_you_mean(name, self.names())}; "
                           f"known: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        """Every known name, registered or only written in a scanned file."""
        return sorted(set(self._items) | set(self.lazy_names()))

    def __contains__(self, name: Any) -> bool:
        return name in self._items or name in self.lazy_names()


strategies: Registry = Registry("strategy", scan=("strategies", "register_strategy"))
tasks: Registry = Registry("evaluation task", scan=("evaluation/tasks", "register_task"))
partitioners: Registry = Registry("partitioner", scan=("data/partition.py", "register_partitioner"))
model_presets: Registry = Registry("model preset")

register_strategy = strategies.register
register_task = tasks.register
register_partitioner = partitioners.register
register_model_preset = model_presets.register
