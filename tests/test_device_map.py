"""``model.device_map``: one model placed over devices (``auto``: accelerate's big-model dispatch), one process."""

import pytest
from safetensors.torch import load_file

from fedllm.engine.server import run
from fedllm.models.loading import ModelError
from fedllm.recipe.checks import parse_recipe
from fedllm.recipe.schema import RecipeError


def test_device_map_auto_trains_like_the_plain_model(tiny_recipe, tmp_path):
    plain = run(parse_recipe({**tiny_recipe(), "output_dir": str(tmp_path / "plain")}))
    placed = run(parse_recipe({**tiny_recipe(model={"name": "tiny-llama", "device_map": "auto"}),
                               "output_dir": str(tmp_path / "auto")}))
    assert hasattr(placed.model.get_base_model(), "hf_device_map")  # dispatched by accelerate
    a = load_file(str(plain.run_dir / "final" / "adapter.safetensors"))
    b = load_file(str(placed.run_dir / "final" / "adapter.safetensors"))
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6  # CPU only here: same devices, same maths


def test_device_map_auto_is_a_one_process_mode(tiny_recipe, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    from fedllm.models.loading import load_base_model, load_tokenizer

    recipe = parse_recipe(tiny_recipe(model={"name": "tiny-llama", "device_map": "auto"}))
    with pytest.raises(ModelError, match="run one process"):
        load_base_model(recipe.model, load_tokenizer(recipe.model))


def test_device_map_values_are_checked(tiny_recipe):
    with pytest.raises(RecipeError, match="model.device_map"):
        parse_recipe(tiny_recipe(model={"name": "tiny-llama", "device_map": "gpu0"}))
