"""Recipes: the typed schema (YAML + dotted overrides) and the checks that need data, models, tasks and strategies."""

from fedllm.common.lazy import lazy_attributes

__getattr__ = lazy_attributes(__name__, {"Recipe": "fedllm.recipe.schema", "RecipeError": "fedllm.recipe.schema",
                                         "load_recipe": "fedllm.recipe.checks", "parse_recipe": "fedllm.recipe.checks"})

__all__ = ["Recipe", "RecipeError", "load_recipe", "parse_recipe"]
