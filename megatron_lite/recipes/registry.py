"""Recipes by name: every function the family packages export (hardware-named and short aliases).

``get_recipe("llama3_70b_pretrain_config")`` builds that recipe's ConfigContainer; an unknown name
is a ConfigError naming the closest ones. Runners and the planner find recipes here, not by
importing arbitrary names (a name from the command line never becomes an import path).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from functools import cache

from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.errors import ConfigError

# The family packages, as upstream's megatron.bridge.recipes.<family>.
FAMILIES = ("llama", "qwen", "mixtral", "gpt")


@cache
def _recipes() -> dict[str, Callable[..., ConfigContainer]]:
    import importlib

    found: dict[str, Callable[..., ConfigContainer]] = {}
    for family in FAMILIES:
        module = importlib.import_module(f"megatron_lite.recipes.{family}")
        for name in module.__all__:
            found[name] = getattr(module, name)
    return found


def recipe_names() -> list[str]:
    """Every recipe's name, sorted (short aliases and hardware-named ones)."""
    return sorted(_recipes())


def get_recipe_function(name: str) -> Callable[..., ConfigContainer]:
    """The recipe function called ``name`` (ConfigError naming close matches when unknown)."""
    recipes = _recipes()
    if name not in recipes:
        close = difflib.get_close_matches(name, recipes, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; known: {', '.join(sorted(recipes))}"
        raise ConfigError("--recipe", f"unknown recipe {name!r}{hint}")
    return recipes[name]


def get_recipe(name: str, **kwargs) -> ConfigContainer:
    """A fresh ConfigContainer of the recipe called ``name`` (``kwargs`` go to the recipe, e.g.
    ``peft_scheme``)."""
    return get_recipe_function(name)(**kwargs)
