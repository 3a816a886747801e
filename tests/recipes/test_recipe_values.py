"""Each recipe equals Megatron-Bridge's for every field megatron_lite has (values read from Bridge's
source, in bridge_recipe_values.py), carries its architecture as the published Hugging Face values,
and is found by name, its short alias included."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from bridge_recipe_values import ALIASES, ARCHITECTURES, DIFFERENCES, RECIPES

from megatron_lite.recipes import get_recipe, get_recipe_function, recipe_names
from megatron_lite.training.config import runtime_config_update
from megatron_lite.training.config.mixed_precision import bf16_mixed
from megatron_lite.training.errors import ConfigError


def _value(cfg, key: str):
    """The field as the recipe set it: a dtype field left to follow the precision reads None."""
    *path, name = key.split(".")
    obj = cfg
    for part in path:
        obj = getattr(obj, part)
    slot = getattr(inspect.getattr_static(type(obj), name, None), "slot", None)
    return obj.__dict__.get(slot) if slot else getattr(obj, name)


def _expected(value):
    if value == "torch.bfloat16":
        return torch.bfloat16
    if value == "bf16_mixed()":
        return bf16_mixed()
    return value


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_equals_bridges_values_for_every_field_megatron_lite_has(name):
    cfg = get_recipe(name)
    wrong = {
        key: (_value(cfg, key), want)
        for key, want in RECIPES[name].items()
        if _value(cfg, key) != _expected(want)
    }
    assert wrong == {}


def test_the_deliberate_differences_from_bridge_are_the_documented_ones():
    cfg = get_recipe("llama3_70b_pretrain_config")
    assert cfg.model.cross_entropy_fusion_impl == DIFFERENCES["model.cross_entropy_fusion_impl"][1]
    assert cfg.model.apply_rope_fusion is DIFFERENCES["model.apply_rope_fusion"][1]
    assert get_recipe("mixtral_8x7b_pretrain_config").model.recompute_method is None


@pytest.mark.parametrize(
    "name, architecture",
    [
        ("llama3_8b_pretrain_config", "llama3_8b"),
        ("llama3_70b_pretrain_config", "llama3_70b"),
        ("llama3_70b_peft_config", "llama3_70b"),
        ("qwen2_7b_pretrain_config", "qwen2_7b"),
        ("mixtral_8x7b_pretrain_config", "mixtral_8x7b"),
        ("gpt2_small_pretrain_cpu_config", "gpt2_small"),
    ],
)
def test_recipe_carries_the_published_architecture_without_the_hub(name, architecture):
    model = get_recipe(name).model
    assert {k: getattr(model, k) for k in ARCHITECTURES[architecture]} == ARCHITECTURES[architecture]


def test_short_names_are_aliases_of_the_hardware_named_recipes():
    for short, full in ALIASES.items():
        assert get_recipe_function(short) is get_recipe_function(full)
    assert {"gpt2_small_pretrain_cpu_config", "mixtral_8x7b_pretrain_config"} <= set(recipe_names())
    assert set(ALIASES) | set(ALIASES.values()) <= set(recipe_names())


def test_an_unknown_recipe_is_one_error_naming_close_matches():
    with pytest.raises(ConfigError) as err:
        get_recipe("llama3_70b_pretrain")
    assert "llama3_70b_pretrain_config" in str(err.value) and "\n" not in str(err.value)


def test_each_call_builds_a_fresh_config():
    a, b = get_recipe("llama3_8b_pretrain_config"), get_recipe("llama3_8b_pretrain_config")
    a.model.num_layers = 2
    assert b.model.num_layers == 32


@pytest.mark.parametrize(
    "name, gpus, dp",
    [
        ("llama3_70b_pretrain_config", 32, 1),
        ("llama3_8b_pretrain_config", 2, 1),
        ("qwen2_7b_pretrain_config", 4, 2),
    ],
)
def test_pretraining_recipe_validates_at_its_gpu_count(name, gpus, dp):
    cfg = get_recipe(name)
    cfg.env_vars = {}  # validation would set them in this process
    cfg.dist.nproc_per_node = gpus
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runtime_config_update(cfg)
    assert cfg.data_parallel_size == dp and cfg.model.bf16 and cfg.optimizer.bf16
    assert cfg.model.vocab_size == 32001  # the NullTokenizer's 32000 ids and its end-of-document id
