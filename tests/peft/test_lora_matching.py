"""Which modules LoRA adapts (Megatron-Bridge's ModuleMatcher): names, ``*`` wildcards over full
names, ``exclude_modules`` over every linear layer, and the one-line refusals."""

from __future__ import annotations

import pytest
import torch
from lora_case_helpers import tiny_gpt

from megatron_lite.peft import LoRA, LoRALinear
from megatron_lite.peft.utils import wildcard_match


def _wrapped(peft) -> list[str]:
    torch.manual_seed(0)
    model = peft(tiny_gpt())
    return sorted(n for n, m in model.named_modules() if isinstance(m, LoRALinear))


@pytest.mark.parametrize(
    "pattern, key, expected",
    [
        ("*.layers.0.*.linear_qkv", "decoder.layers.0.self_attention.linear_qkv", True),
        ("*.layers.0.*.linear_qkv", "decoder.layers.1.self_attention.linear_qkv", False),
        ("*.layers.0.*.linear_qkv", "decoder.layers.10.self_attention.linear_qkv", False),
        ("*linear_fc*", "decoder.layers.3.mlp.linear_fc2", True),
        ("decoder.layers.*.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1", True),
        ("linear_qkv", "decoder.layers.0.self_attention.linear_qkv", False),  # names match by equality
    ],
)
def test_wildcard_match(pattern, key, expected):
    assert wildcard_match(pattern, key) is expected


def test_wildcard_match_of_no_key_is_none():
    assert wildcard_match("*", None) is None


def test_target_names_match_every_layer():
    assert _wrapped(LoRA(target_modules=["linear_proj"])) == [
        "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.1.self_attention.linear_proj",
    ]


def test_wildcard_targets_select_layers():
    assert _wrapped(LoRA(target_modules=["*.layers.0.*.linear_qkv", "*.layers.1.mlp.linear_fc2"])) == [
        "decoder.layers.0.self_attention.linear_qkv",
        "decoder.layers.1.mlp.linear_fc2",
    ]


def test_exclude_modules_adapt_every_other_linear():
    wrapped = _wrapped(LoRA(target_modules=[], exclude_modules=["linear_fc2", "*.layers.1.*"]))
    assert wrapped == [
        "decoder.layers.0.mlp.linear_fc1",
        "decoder.layers.0.self_attention.linear_proj",
        "decoder.layers.0.self_attention.linear_qkv",
        "output_layer",
    ]


def test_targets_and_excludes_together_are_refused():
    with pytest.raises(ValueError, match="exclude_modules needs target_modules to be empty"):
        _wrapped(LoRA(exclude_modules=["linear_fc2"]))


def test_a_target_that_matches_nothing_warns_and_wraps_nothing(caplog):
    with caplog.at_level("WARNING"):
        assert _wrapped(LoRA(target_modules=["linear_qkvv"])) == []
    assert "linear_qkvv" in caplog.text


def test_target_modules_changed_after_construction_are_used():
    peft = LoRA()
    peft.target_modules = ["linear_fc1"]
    assert _wrapped(peft) == ["decoder.layers.0.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc1"]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(dim=0), "dim must be positive"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(dropout_position="middle"), "dropout_position must be"),
        (dict(lora_A_init_method="orthogonal"), "lora_A_init_method must be one of"),
        (dict(a2a_experimental=True), "a2a_experimental is not supported"),
        (dict(experts_shared_outer_loras=True), "experts_shared_outer_loras is not supported"),
    ],
)
def test_unsupported_settings_are_refused_in_one_line(fields, message):
    with pytest.raises(ValueError, match=message) as error:
        LoRA(**fields).validate()
    assert "\n" not in str(error.value)
