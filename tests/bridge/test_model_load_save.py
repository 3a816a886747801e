"""Megatron-Bridge's ``training.model_load_save`` and AutoBridge's checkpoint round trip outside a
run: a Hugging Face directory imported as a megatron_lite checkpoint, loaded back from the config the
checkpoint recorded (no Hugging Face config involved), and exported again to the same tensors."""

from __future__ import annotations

import os

import pytest
import torch
from bridge_helpers import save_family
from safetensors.torch import load_file

from megatron_lite.bridge import AutoBridge
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.model_load_save import load_megatron_model, load_model_config


def test_a_checkpoint_loads_from_its_own_config_and_exports_the_same_tensors(tmp_path):
    save_family("llama", tmp_path / "hf")
    environment = dict(os.environ)
    AutoBridge.import_ckpt(str(tmp_path / "hf"), str(tmp_path / "megatron"))

    provider, megatron_lm_args = load_model_config(tmp_path / "megatron")
    assert megatron_lm_args is None
    assert (provider.num_layers, provider.hidden_size, provider.num_query_groups) == (4, 64, 2)
    assert provider.activation_func is torch.nn.functional.silu and provider.gated_linear_unit
    state = load_megatron_model(tmp_path / "megatron", return_state_dict=True)
    source = load_file(tmp_path / "hf" / "model.safetensors")
    torch.testing.assert_close(
        state["decoder.layers.0.mlp.linear_fc2.weight"],
        source["model.layers.0.mlp.down_proj.weight"],
        rtol=0,
        atol=0,
    )

    AutoBridge.from_hf_pretrained(str(tmp_path / "hf")).export_ckpt(
        str(tmp_path / "megatron"), str(tmp_path / "out"), show_progress=False
    )
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == source.keys()
    for name, tensor in source.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    # A bridge from the checkpoint's own model, in the Hugging Face model's keys (from_auto_config).
    config = AutoBridge.from_auto_config(str(tmp_path / "megatron"), str(tmp_path / "hf")).hf_pretrained
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (4, 64, 2)
    assert dict(os.environ) == environment  # the one-rank worlds left the caller's environment alone
    assert not torch.distributed.is_initialized()


def test_a_directory_without_a_checkpoint_is_one_error(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_model_config(tmp_path)
