"""Recipes' models built on the meta device (no weights, no memory) and their cost reports, cached per session."""

import logging

import pytest


@pytest.fixture(scope="session")
def meta_costs():
    """``meta_costs(recipe_path, *overrides)``: the :class:`fedllm.commands.cost_report.CostReport` of the recipe's model on
    the meta device (forced, even where the weights happen to be cached)."""
    from fedllm.commands.dry_run import untimed
    from fedllm.recipe.checks import load_recipe

    cache = {}

    def get(path, *overrides):
        key = (path, overrides)
        if key not in cache:
            fedllm_log = logging.getLogger("fedllm")
            level = fedllm_log.level
            fedllm_log.setLevel(logging.ERROR)  # quiet while building, then as it was (later tests read warnings)
            try:
                recipe = load_recipe(path, list(overrides), check_files=False)
                cache[key] = untimed(recipe, weights_missing="tests: meta device").costs
            finally:
                fedllm_log.setLevel(level)
        return cache[key]

    return get
