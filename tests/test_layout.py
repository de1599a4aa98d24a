"""fedllm/'s layout (docs/DESIGN.md §1): every import points down the layers, and no import circle exists.

Imports are read from the source with ``ast``, those inside functions included, so a lazy import cannot hide
a circle. A module may import its own layer or a lower one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fedllm"

LAYERS = [  # bottom to top: the folders of fedllm/ (recipe/ is two layers: its schema and its checks)
    "common",  # with fedllm/__init__ (its version and the deprecated paths' table): the ground floor
    "recipe.schema recipe.schedule",
    "data",
    "models",
    "runs",
    "strategies",
    "privacy",
    "evaluation",
    "engine",
    "recipe recipe.checks",
    "export",
    "flower",
    "commands",
    "__main__",
]
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units.split()}
RANK[""] = RANK["common"]


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """``fedllm.x.y`` -> file, for every module of the package (a package's ``__init__`` under its own name)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The fedllm modules that module ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            candidates = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known] or [base]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate.startswith("fedllm") and candidate != name:
                targets.add(candidate)
    return targets


def unit(module: str) -> str:
    """The layer unit of a module: ``fedllm.recipe.schema`` -> ``recipe.schema``, ``fedllm.data.x`` -> ``data``."""
    rest = module.split(".")[1:]
    for n in range(len(rest), -1, -1):
        if ".".join(rest[:n]) in RANK:
            return ".".join(rest[:n])
    raise AssertionError(f"{module}: in no layer of LAYERS (add its folder to docs/DESIGN.md §1 and here)")


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def test_every_import_points_down_the_layers(graph):
    upward = sorted(f"{m} ({unit(m)}) imports {t} ({unit(t)})" for m, targets in graph.items() for t in targets
                    if RANK[unit(t)] > RANK[unit(m)])
    assert not upward, "imports that run upward:\n" + "\n".join(upward)


def test_no_import_circle(graph):
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_top_level_reads_as_the_architecture():
    entries = sorted(p.name for p in PACKAGE.iterdir() if p.name not in ("__init__.py", "__main__.py", "assets",
                                                                         "__pycache__", "py.typed"))
    assert len(entries) <= 12, entries
    for entry in entries:
        init = PACKAGE / entry / "__init__.py" if (PACKAGE / entry).is_dir() else PACKAGE / entry
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        assert doc and doc.strip(), f"fedllm/{entry}: no docstring saying what lives there"
        assert entry.removesuffix(".py") in RANK, f"fedllm/{entry}: in no layer"


def test_the_walk_counts_function_level_and_relative_imports(tmp_path):
    """The checker itself: an import inside a function is an edge, a relative one resolves, a circle is seen."""
    pkg = tmp_path / "fedllm"
    for folder in ("data", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "data" / "loading.py").write_text("def f():\n    from fedllm.engine.server import run\n")
    (pkg / "engine" / "server.py").write_text("from ..data import loading\nimport fedllm.data\n")
    known = modules(pkg)
    edges = {name: imports(name, path, known) for name, path in known.items()}
    assert edges["fedllm.data.loading"] == {"fedllm.engine.server"}
    assert edges["fedllm.engine.server"] == {"fedllm.data.loading", "fedllm.data"}
    assert RANK[unit("fedllm.data.loading")] < RANK[unit("fedllm.engine.server")]  # so the first edge is upward


def test_the_recipe_schema_imports_no_heavy_library():
    """Rule 4 of the layout: the schema is the floor every layer stands on, so it must stay light."""
    import subprocess
    import sys

    code = ("import sys, fedllm.recipe.schema, fedllm.recipe.schedule; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'datasets', 'numpy') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
