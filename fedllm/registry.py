"""Registries: strategies, tasks, partitioners and model presets are picked by name."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A name -> object map filled by decorators."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator registering ``obj`` under ``name``."""

        def deco(obj: T) -> T:
            if name in self._items and self._items[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            return obj

        return deco

    def get(self, name: str) -> T:
        """The object registered as ``name``; KeyError naming the known ones otherwise."""
        if name not in self._items:
            raise KeyError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: Any) -> bool:
        return name in self._items


strategies: Registry = Registry("strategy")
tasks: Registry = Registry("evaluation task")
partitioners: Registry = Registry("partitioner")
model_presets: Registry = Registry("model preset")

register_strategy = strategies.register
register_task = tasks.register
register_partitioner = partitioners.register
register_model_preset = model_presets.register
