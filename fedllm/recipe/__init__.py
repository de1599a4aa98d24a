"""Recipes: the typed schema (YAML + dotted overrides) and the checks that need data, models, tasks and strategies."""
