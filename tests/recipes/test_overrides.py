"""``section.field=value`` overrides (Megatron-Bridge's syntax): values read as YAML and converted to
the field's declared type; a key that names nothing or a value of the wrong type is one ConfigError
line naming the key and what it expects."""

from __future__ import annotations

import pytest
import torch

from megatron_lite.recipes import apply_overrides, get_recipe
from megatron_lite.recipes.overrides import apply_mapping
from megatron_lite.training.errors import ConfigError


@pytest.fixture(scope="module")
def recipe():
    return get_recipe("llama3_70b_pretrain_config")


@pytest.fixture
def cfg():
    return get_recipe("llama3_8b_pretrain_config")


def test_values_take_the_fields_declared_types(cfg):
    apply_overrides(
        cfg,
        [
            "model.tensor_model_parallel_size=2",
            "optimizer.lr=1e-4",  # YAML 1.1 reads this as a string: the float field converts it
            "model.sequence_parallel=true",
            "model.virtual_pipeline_model_parallel_size=null",
            "checkpoint.save=/tmp/x",
            "model.pipeline_dtype=torch.float16",
            "model.params_dtype=bfloat16",
            "train.rampup_batch_size=[16, 16, 100]",
            "optimizer.weight_decay=0",  # an int where a float is declared
            "peft=null",
        ],
    )
    m = cfg.model
    assert m.tensor_model_parallel_size == 2 and m.sequence_parallel is True
    assert m.virtual_pipeline_model_parallel_size is None and cfg.checkpoint.save == "/tmp/x"
    assert m.pipeline_dtype is torch.float16 and m.params_dtype is torch.bfloat16
    assert cfg.optimizer.lr == 1e-4 and isinstance(cfg.optimizer.weight_decay, float)
    assert cfg.train.rampup_batch_size == [16, 16, 100]


def test_a_later_override_of_the_same_field_wins(cfg):
    apply_overrides(cfg, ["train.train_iters=5", "train.train_iters=7"])
    assert cfg.train.train_iters == 7


@pytest.mark.parametrize(
    "override, key, said",
    [
        (
            "model.tensor_model_paralel_size=2",
            "model.tensor_model_paralel_size",
            "tensor_model_parallel_size",
        ),
        ("trian.train_iters=2", "trian.train_iters", "did you mean train"),
        ("model.tensor_model_parallel_size=two", "model.tensor_model_parallel_size", "expects int"),
        ("model.sequence_parallel=1", "model.sequence_parallel", "expects bool"),
        ("optimizer.lr=fast", "optimizer.lr", "expects float"),
        ("model.pipeline_dtype=torch.nonsense", "model.pipeline_dtype", "torch dtype"),
        ("train.train_iters.x=2", "train.train_iters.x", "not a section"),
        ("model=3", "model", "expects GPTModelProvider"),
        ("~model.num_layers", "model.num_layers", "cannot be removed"),
        ("train.train_iters", "train.train_iters", "expected section.field=value"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_key(cfg, override, key, said):
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, [override])
    text = str(err.value)
    assert text.startswith(f"{key}: ") and said in text and "\n" not in text


def test_plus_adds_and_tilde_removes_a_dict_key_and_tilde_clears_an_optional_field(cfg):
    apply_overrides(cfg, ["+env_vars.MY_FLAG=1", "~env_vars.NCCL_NVLS_ENABLE", "~checkpoint.load"])
    assert cfg.env_vars["MY_FLAG"] == 1 and "NCCL_NVLS_ENABLE" not in cfg.env_vars
    assert cfg.checkpoint.load is None
    with pytest.raises(ConfigError, match="add one with"):
        apply_overrides(cfg, ["env_vars.OTHER=1"])


def test_a_mixed_precision_recipe_name_is_opened_for_its_fields(cfg):
    assert cfg.mixed_precision == "bf16_mixed"
    apply_overrides(cfg, ["mixed_precision.grad_reduce_in_fp32=false"])
    assert cfg.mixed_precision.bf16 is True and cfg.mixed_precision.grad_reduce_in_fp32 is False


def test_a_nested_mapping_sets_sections_fields_and_merges_dicts(cfg):
    apply_mapping(cfg, {"model": {"num_layers": 4, "context_parallel_size": 1}, "env_vars": {"X": "1"}})
    assert cfg.model.num_layers == 4 and cfg.model.context_parallel_size == 1
    assert cfg.env_vars["X"] == "1" and "NCCL_NVLS_ENABLE" in cfg.env_vars  # merged, not replaced
    with pytest.raises(ConfigError, match=r"^model\.hiden_size: .*hidden_size"):
        apply_mapping(cfg, {"model": {"hiden_size": 3}})


def test_overrides_leave_other_recipes_untouched(recipe):
    apply_overrides(get_recipe("llama3_70b_pretrain_config"), ["model.num_layers=2"])
    assert recipe.model.num_layers == 80 and get_recipe("llama3_70b_pretrain_config").model.num_layers == 80
