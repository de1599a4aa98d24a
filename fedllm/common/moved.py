"""Module paths of fedllm's first flat layout, still importable for one release with a DeprecationWarning.

``import fedllm.config`` or ``from fedllm.server import run`` keep working: the old name is served by a
stand-in module whose attributes come from the new modules, and each attribute read warns with the new path
(``fedllm.config.load_recipe is deprecated: use fedllm.recipe.checks.load_recipe``). An attribute *write* (a test's
``monkeypatch.setattr(fedllm.client, "train_client", fake)``) goes to the module that holds the name, with the
same warning, so the patch reaches the code that calls it; deleting the name through the old path puts back what
the first such write replaced (pytest's ``undo`` deletes what it set on a module without the name in its
``__dict__``). A write of a name no new module holds, or a delete of one never written, is refused, naming them. Only the paths below are served, and only when no real module has the name.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings
from importlib.machinery import ModuleSpec

MOVED: dict[str, tuple[str, ...]] = {
    "fedllm.config": ("fedllm.recipe.schema", "fedllm.recipe.checks"),
    "fedllm.server": ("fedllm.engine.server",),
    "fedllm.client": ("fedllm.engine.client", "fedllm.recipe.schedule"),
    "fedllm.batched_clients": ("fedllm.engine.batched_clients",),
    "fedllm.client_faults": ("fedllm.engine.client_faults",),
    "fedllm.distributed": ("fedllm.engine.distributed",),
    "fedllm.client_store": ("fedllm.runs.client_store",),
    "fedllm.checkpoint": ("fedllm.runs.checkpoint",),
    "fedllm.rundir": ("fedllm.runs.rundir",),
    "fedllm.runlock": ("fedllm.runs.runlock",),
    "fedllm.resume_check": ("fedllm.runs.resume_check",),
    "fedllm.base_history": ("fedllm.runs.base_history",),
    "fedllm.strict_json": ("fedllm.runs.strict_json",),
    "fedllm.plot": ("fedllm.runs.plot", "fedllm.commands.plot"),
    "fedllm.model_info": ("fedllm.models.info",),
    "fedllm.gguf_cache": ("fedllm.models.gguf_cache",),
    "fedllm.chunked_weights": ("fedllm.models.chunked_weights",),
    "fedllm.hub": ("fedllm.models.hub",),
    "fedllm.lowrank": ("fedllm.models.lowrank",),
    "fedllm.supervised_loss": ("fedllm.models.supervised_loss",),
    "fedllm.state": ("fedllm.models.state",),
    "fedllm.inference": ("fedllm.export.inference",),
    "fedllm.cli": ("fedllm.commands.cli",),
    "fedllm.train_cli": ("fedllm.commands.train",),
    "fedllm.dry_run": ("fedllm.commands.dry_run",),
    "fedllm.cost_report": ("fedllm.commands.cost_report",),
    "fedllm.serve": ("fedllm.commands.serve",),
    "fedllm.evaluation.cli": ("fedllm.commands.evaluate",),
    "fedllm.export.cli": ("fedllm.commands.export",),
    "fedllm.flower.commands": ("fedllm.commands.flower",),
    "fedllm.errors": ("fedllm.common.errors",),
    "fedllm.logs": ("fedllm.common.logs",),
    "fedllm.redact": ("fedllm.common.redact",),
    "fedllm.threads": ("fedllm.common.threads",),
    "fedllm.lazy": ("fedllm.common.lazy",),
    "fedllm.registry": ("fedllm.common.registry",),
    "fedllm.tracking": ("fedllm.common.tracking",),
}
"""Old module path -> the modules that now hold its names, searched in order."""

_REPLACED: dict[tuple[str, str], tuple[types.ModuleType, object]] = {}
"""(old path, name) -> the new module and the value a write through the old path replaced there (until deleted)."""


class MovedModule(types.ModuleType):
    """Stand-in for an old module path: each attribute is read from the new modules, with a warning."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._holder(name, "read"), name)

    def __setattr__(self, name: str, value: object) -> None:
        if name.startswith("__"):  # the import system's __spec__, __loader__ ...: the stand-in's own
            super().__setattr__(name, value)
            return
        module = self._holder(name, "write")
        _REPLACED.setdefault((self.__name__, name), (module, getattr(module, name)))
        setattr(module, name, value)

    def __delattr__(self, name: str) -> None:
        if name.startswith("__"):
            super().__delattr__(name)
            return
        if (self.__name__, name) not in _REPLACED:
            raise AttributeError(f"module {self.__name__!r} (moved to {', '.join(MOVED[self.__name__])}) holds no "
                                 f"attribute {name!r} written through it: nothing to delete (use the new module's path)")
        module, value = _REPLACED.pop((self.__name__, name))
        setattr(module, name, value)

    def _holder(self, name: str, what: str) -> types.ModuleType:
        """The first new module holding ``name`` (warned about with its new path); AttributeError when none does."""
        old = self.__name__
        for target in MOVED[old]:
            module = importlib.import_module(target)
            if hasattr(module, name):
                warnings.warn(f"{old}.{name} is deprecated: use {target}.{name}", DeprecationWarning, stacklevel=3)
                return module
        raise AttributeError(f"module {old!r} (moved to {', '.join(MOVED[old])}) has no attribute {name!r}"
                             + ("" if what == "read" else f": nothing to {what} (use the new module's path)"))


class MovedModuleFinder:
    """Meta path finder and loader of the old paths of :data:`MOVED`, consulted after every real finder
    (the protocol of :mod:`importlib.abc`, not imported: it costs ``fedllm --help`` 5 ms)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        return MovedModule(spec.name, f"Deprecated path: moved to {', '.join(MOVED[spec.name])}.")

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run: the attributes are read on demand."""


def serve_moved_modules() -> None:
    """Make the old paths importable (idempotent; ``fedllm/__init__`` calls it)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
