"""LoRA's command line (``--peft lora`` and the ``--lora-*`` flags onto Megatron-Bridge's LoRA fields)
and its validation: one line naming the flag for anything megatron_lite cannot run."""

from __future__ import annotations

import pytest

from megatron_lite.peft import LoRA
from megatron_lite.training.cli.parser import config_from_argv
from megatron_lite.training.config import ConfigContainer, ConfigError


@pytest.fixture
def base(tmp_path):
    return ["--pretrained-checkpoint", str(tmp_path)]  # validation only checks that it exists


def test_flags_set_bridges_lora_fields(base):
    cfg = config_from_argv(
        [*base, "--peft", "lora", "--lora-dim", "16", "--lora-alpha", "8", "--lora-dropout", "0.1"]
        + [
            "--lora-dropout-position",
            "post",
            "--lora-target-modules",
            "linear_qkv",
            "*.layers.0.*.linear_proj",
        ]
        + ["--lora-a-init-method", "kaiming", "--lora-b-init-method", "normal"]
    )
    p = cfg.peft
    assert isinstance(p, LoRA)
    assert (p.dim, p.alpha, p.dropout, p.dropout_position) == (16, 8, 0.1, "post")
    assert p.target_modules == ["linear_qkv", "*.layers.0.*.linear_proj"]
    assert (p.lora_A_init_method, p.lora_B_init_method) == ("kaiming", "normal")


def test_defaults_are_bridges_and_no_peft_is_full_training(base):
    assert config_from_argv(base).peft is None
    p = config_from_argv([*base, "--peft", "lora"]).peft
    assert (p.dim, p.alpha, p.dropout, p.target_modules) == (32, 32, 0.0, LoRA().target_modules)


def test_exclude_modules_alone_adapts_every_other_linear(base):
    p = config_from_argv([*base, "--peft", "lora", "--lora-exclude-modules", "linear_fc2"]).peft
    assert (p.target_modules, p.exclude_modules) == ([], ["linear_fc2"])


@pytest.mark.parametrize(
    "argv,flag,words",
    [
        (["--peft", "dora"], "--peft", "LoRA only"),
        (["--lora-dim", "8"], "--lora-dim", "needs --peft lora"),
        (
            ["--peft", "lora", "--lora-dim", "6", "--tensor-model-parallel-size", "4"],
            "--lora-dim",
            "divisible",
        ),
        (["--peft", "lora", "--lora-dropout-position", "mid"], "--lora-dropout-position", "'pre' or 'post'"),
        (["--peft", "lora", "--lora-b-init-method", "ones"], "--lora-b-init-method", "xavier"),
        (["--peft", "lora", "--lora-exclude-modules", "a", "--lora-target-modules", "b"], "--lora-", "empty"),
    ],
)
def test_what_cannot_run_is_one_line_naming_the_flag(base, argv, flag, words):
    with pytest.raises(ConfigError) as err:
        config_from_argv([*base, *argv])
    assert str(err.value).startswith(flag) and words in str(err.value) and "\n" not in str(err.value)


def test_peft_needs_the_base_checkpoint_on_the_command_line_and_in_python():
    with pytest.raises(ConfigError, match="^--peft: needs --pretrained-checkpoint"):
        config_from_argv(["--peft", "lora"])
    with pytest.raises(ConfigError, match="^--peft: needs --pretrained-checkpoint"):
        ConfigContainer(peft=LoRA()).validate()
