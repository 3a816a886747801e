"""Ready-made run configurations, Megatron-Bridge's ``megatron.bridge.recipes``: one folder per model
family (``llama``, ``qwen``, ``mixtral``, ``gpt``), hardware-named recipes in ``<family>/h100/`` with
upstream's short names as aliases, the shared starting points in ``common``, the architectures as
data in ``architectures``, ``section.field=value`` overrides in ``overrides`` and the runner behind
``scripts/training/run_recipe.py`` in ``runner``.

``get_recipe(name)`` builds a recipe's ConfigContainer, ``recipe_names()`` lists them,
``apply_overrides(config, ["model.tensor_model_parallel_size=2", ...])`` changes fields by name.
"""

from megatron_lite.recipes.overrides import apply_overrides
from megatron_lite.recipes.registry import get_recipe, get_recipe_function, recipe_names


def __getattr__(name: str):
    # megatron.bridge.recipes.<recipe_name>: each recipe function by name, imported when asked for.
    if name.endswith("_config"):
        try:
            return get_recipe_function(name)
        except ValueError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["apply_overrides", "get_recipe", "get_recipe_function", "recipe_names"]
