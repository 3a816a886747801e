"""``sequence_parallel_input_regather`` (Megatron-Bridge's LoRA option): under sequence parallelism a
column-parallel base's adapter keeps its input split by sequence, not gathered. One process as rank 0
of a fake two-rank world (torch's "fake" backend: collectives give shapes, not values), so what each
path saves for backward is measured without spawning a world; the numbers are the world test's
(test_lora_parallel_world.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.model_parallel_config import ModelParallelConfig
from megatron_lite.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_lite.peft import LoRA

S, B, H, OUT, DIM = 32, 2, 16, 48, 4
TP = 2


@pytest.fixture
def fake_tp2_world():
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=TP)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _saved_bytes(layer, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of ``layer(x)``."""
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _ = layer(x)
    del out
    return sum(storages.values())


def _adapted(base_cls, regather: bool, tp_group, **base_kwargs):
    config = ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=True)
    in_features = H * TP if base_cls is RowParallelLinear else H
    base = base_cls(
        in_features, OUT, config=config, init_method=nn.init.xavier_normal_, bias=False,
        tp_group=tp_group, **base_kwargs,
    )  # fmt: skip
    return _wrap(base, regather)


def _wrap(base, regather: bool):
    """``base`` as a LoRA model's linear_qkv (a row-parallel one as linear_proj)."""
    name = "linear_proj" if isinstance(base, RowParallelLinear) else "linear_qkv"
    holder = nn.Module()
    holder.add_module(name, base)
    LoRA(dim=DIM, target_modules=[name], sequence_parallel_input_regather=regather)(holder)
    return getattr(holder, name)


def test_regather_keeps_the_sequence_slice_of_a_column_parallel_adapters_input(fake_tp2_world):
    x = torch.randn(S // TP, B, H, requires_grad=True)  # this rank's sequence slice
    standard = _adapted(ColumnParallelLinear, False, fake_tp2_world, gather_output=False)
    regather = _adapted(ColumnParallelLinear, True, fake_tp2_world, gather_output=False)
    assert regather.adapter.regathers_input and not standard.adapter.regathers_input
    low_rank = S * B * DIM * 4  # linear_out's input, whole over TP: kept by both
    assert _saved_bytes(standard, x) == S * B * H * 4 + low_rank  # the gathered sequence
    assert _saved_bytes(regather, x) == S // TP * B * H * 4 + low_rank  # this rank's slice (x itself)


def test_regather_leaves_a_row_parallel_adapter_as_it_is(fake_tp2_world):
    """linear_proj / linear_fc2: the input is split by columns, not by sequence; nothing to regather."""
    x = torch.randn(S, B, H, requires_grad=True)
    standard = _adapted(RowParallelLinear, False, fake_tp2_world, input_is_parallel=True, skip_bias_add=False)
    regather = _adapted(RowParallelLinear, True, fake_tp2_world, input_is_parallel=True, skip_bias_add=False)
    assert not regather.adapter.regathers_input
    assert _saved_bytes(regather, x) == _saved_bytes(standard, x)


def test_regather_changes_nothing_without_sequence_parallelism():
    base = ColumnParallelLinear(
        H, OUT, config=ModelParallelConfig(), init_method=nn.init.xavier_normal_, bias=False
    )
    wrapped = _wrap(base, True)
    assert not wrapped.adapter.regathers_input


def test_the_flag_sets_bridges_field_and_needs_peft_lora(tmp_path):
    from megatron_lite.training.cli.parser import config_from_argv
    from megatron_lite.training.config import ConfigError

    base = ["--pretrained-checkpoint", str(tmp_path)]
    flag = "--lora-sequence-parallel-input-regather"
    assert config_from_argv([*base, "--peft", "lora", flag]).peft.sequence_parallel_input_regather
    assert not config_from_argv([*base, "--peft", "lora"]).peft.sequence_parallel_input_regather
    with pytest.raises(ConfigError) as err:
        config_from_argv([*base, flag])
    assert str(err.value) == f"{flag}: needs --peft lora (it sets a field of LoRA fine-tuning)"
