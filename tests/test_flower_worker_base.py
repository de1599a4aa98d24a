"""A node worker keeps the base model across runs of the same model (fedllm.models.kept_bases): a later run's
federation gets a copy of the base from memory, and equals, tensor for tensor, one built from scratch."""

import pytest
import torch

from fedllm.engine.server import build_federation
from fedllm.models import kept_bases
from fedllm.recipe.checks import parse_recipe


def full_state(fed) -> dict:
    return {k: v.detach().clone() for k, v in fed.loaded.model.state_dict().items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not different, different[:5]


@pytest.fixture
def keeping():
    kept_bases.keep()
    yield
    kept_bases.keep(False)


def test_worker_builds_a_second_run_from_the_kept_base_bit_for_bit(tiny_recipe, keeping):
    def recipe(**sections):
        return parse_recipe(tiny_recipe(**sections), "<test>", [])

    frlora = {"lora": {"r": 2, "alpha": 4}, "federation": {"strategy": "frlora"}}  # another LoRA, a base-changing setup
    kept_bases.keep(False)
    expected_frlora, expected_fedavg = full_state(build_federation(recipe(**frlora))), full_state(
        build_federation(recipe()))
    kept_bases.keep()
    hits = kept_bases.hits
    assert_same(full_state(build_federation(recipe())), expected_fedavg)  # loaded, and kept
    assert kept_bases.hits == hits
    assert_same(full_state(build_federation(recipe(**frlora))), expected_frlora)  # the kept base, copied
    assert_same(full_state(build_federation(recipe())), expected_fedavg)  # FRLoRA's W0 - sBA left the kept one alone
    assert kept_bases.hits == hits + 2
    build_federation(recipe(seed=1))  # another model (a tiny model's weights follow the seed): loaded
    assert kept_bases.hits == hits + 2
