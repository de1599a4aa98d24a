"""The flat layout's public names keep working for one release, each warning with its new path.

``fedllm.config.load_recipe``, ``fedllm.server.run``, ``fedllm.models.load_model`` and
``fedllm.strategies.get_strategy`` are the names README, DESIGN.md §2 and notebooks used.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fedllm.common.moved import MOVED

PACKAGE = Path(__file__).resolve().parent.parent / "fedllm"


@pytest.mark.parametrize("old, name, new", [
    ("fedllm.config", "load_recipe", "fedllm.recipe.checks"),
    ("fedllm.config", "Recipe", "fedllm.recipe.schema"),
    ("fedllm.server", "run", "fedllm.engine.server"),
    ("fedllm.registry", "register_strategy", "fedllm.common.registry"),
    ("fedllm.inference", "load_for_inference", "fedllm.export.inference"),
])
def test_an_old_path_gives_the_same_object_and_warns_with_the_new_path(old, name, new):
    module = importlib.import_module(old)
    with pytest.warns(DeprecationWarning, match=rf"^{old}\.{name} is deprecated: use {new}\.{name}$"):
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(new), name)


def test_the_warning_points_at_the_line_that_used_the_old_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from fedllm.config import load_recipe  # noqa: F401
        from fedllm.server import run  # noqa: F401
    assert [(w.category, Path(w.filename).name) for w in caught] == [(DeprecationWarning, Path(__file__).name)] * 2


def test_models_load_model_and_get_strategy_keep_their_paths_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        from fedllm.engine import run
        from fedllm.models import load_base_model, load_model
        from fedllm.recipe import load_recipe
        from fedllm.strategies import get_strategy
    from fedllm.engine.server import run as engine_run
    from fedllm.models import loading
    from fedllm.recipe.checks import load_recipe as checks_load_recipe

    assert (load_model, load_base_model) == (loading.load_model, loading.load_base_model)
    assert (run, load_recipe) == (engine_run, checks_load_recipe)
    assert type(get_strategy("fedavg")).__name__ == "FedAvg"


def test_every_old_path_is_no_file_and_every_new_one_imports():
    for old, targets in MOVED.items():
        relative = Path(*old.split(".")[1:])
        assert not (PACKAGE / relative).with_suffix(".py").exists() and not (PACKAGE / relative).is_dir(), old
        for target in targets:
            importlib.import_module(target)
        assert importlib.import_module(old).__name__ == old


def test_a_name_the_new_modules_lack_is_an_attribute_error_naming_them():
    import fedllm.server

    with pytest.raises(AttributeError, match=r"'fedllm.server' \(moved to fedllm.engine.server\) has no attribute"):
        fedllm.server.nope  # noqa: B018


def test_a_script_using_the_old_path_runs_and_is_told_the_new_one(tmp_path):
    """Python's default filters, in a fresh interpreter: the warning shows. (A recipe section, not parse_recipe: its
    strategy check imports every strategy, hence torch, which is not what this shows.)"""
    script = tmp_path / "notebook_cell.py"
    script.write_text("import fedllm.config as config\n"
                      "model = config.ModelConfig(name='tiny-llama')\n"
                      "print(type(model).__module__, model.name)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["fedllm.recipe.schema", "tiny-llama"]
    assert "DeprecationWarning: fedllm.config.ModelConfig is deprecated: use fedllm.recipe.schema.ModelConfig" \
        in done.stderr


def test_patching_an_old_path_reaches_the_code_that_calls_the_name(monkeypatch):
    """Issue 49 item 15: ``monkeypatch.setattr(fedllm.client, "train_client", fake)`` used to land on the stand-in
    and leave ``run_client`` calling the real ``train_client``; the write now goes to the new module, and the undo
    restores it there."""
    import fedllm.client

    import fedllm.engine.client as new

    real = new.train_client

    def fake(*args, **kwargs):
        raise AssertionError("not called")

    with pytest.warns(DeprecationWarning, match=r"^fedllm.client.train_client is deprecated: "
                                                r"use fedllm.engine.client.train_client$"):
        monkeypatch.setattr(fedllm.client, "train_client", fake)
    assert new.train_client is fake and new.run_client.__globals__["train_client"] is fake
    assert "train_client" not in vars(fedllm.client)  # nothing shadows the name on the stand-in
    monkeypatch.undo()
    assert new.train_client is real and "train_client" not in vars(fedllm.client)


def test_a_write_or_delete_of_a_name_no_new_module_holds_is_refused_naming_them():
    import fedllm.client

    with pytest.raises(AttributeError, match=r"'fedllm.client' \(moved to fedllm.engine.client, fedllm.recipe.schedule"
                                             r"\) has no attribute 'nope': nothing to write"):
        fedllm.client.nope = 1
    with pytest.raises(AttributeError, match="nothing to delete"):
        del fedllm.client.train_client  # never written through the old path: the real one stays
    assert callable(importlib.import_module("fedllm.engine.client").train_client)
    assert "nope" not in vars(fedllm.client)
