"""A pre-norm transformer layer."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.packed_seq_params import PackedSeqParams
from megatron_lite.core.process_group_utils import get_pg_size
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel.random import checkpoint, get_cuda_rng_tracker
from megatron_lite.core.transformer.attention import SelfAttention
from megatron_lite.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron_lite.core.transformer.mlp import MLP
from megatron_lite.core.transformer.moe.moe_layer import MoELayer, is_moe_layer
from megatron_lite.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_lite.core.transformer.pipeline_layer_split import chunk_layer_offset
from megatron_lite.core.transformer.spec_utils import get_submodules, spec_module
from megatron_lite.core.transformer.torch_norm import WrappedTorchNorm
from megatron_lite.core.transformer.transformer_config import TransformerConfig


def get_transformer_layer_offset(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> int:
    """Global index of the first layer of model chunk ``vp_stage`` of pipeline stage ``pp_rank``
    (this process's stage when None)."""
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    if vp_stage is None and (config.virtual_pipeline_model_parallel_size or 1) > 1:
        raise ValueError("vp_stage must be given when the virtual pipeline size is set")
    return chunk_layer_offset(config, vp_stage or 0, pp_rank)


@dataclass
class TransformerLayerSubmodules:
    """What a layer spec says a transformer layer is built of (upstream's fields). megatron_lite's
    layer reads ``mlp`` (a dense MLP or a MoELayer, with its experts) and ``self_attention`` (no
    query / key norms); the norms follow ``config.normalization`` and bias-dropout-add is built in."""

    input_layernorm: object = IdentityOp
    self_attention: object = IdentityOp
    self_attn_bda: object = IdentityFuncOp
    pre_cross_attn_layernorm: object = IdentityOp
    cross_attention: object = IdentityOp
    cross_attn_bda: object = IdentityFuncOp
    pre_mlp_layernorm: object = IdentityOp
    mlp: object = IdentityOp
    mlp_bda: object = IdentityFuncOp
    sharded_state_dict_keys_map: dict = field(default_factory=dict)


def _check_supported(submodules: TransformerLayerSubmodules) -> None:
    attention = getattr(submodules.self_attention, "submodules", None)
    for norm in (getattr(attention, "q_layernorm", None), getattr(attention, "k_layernorm", None)):
        if norm not in (None, IdentityOp):
            raise NotImplementedError(
                "query / key layer norms (qk_layernorm) are not supported by megatron_lite"
            )
    if submodules.cross_attention is not IdentityOp:
        raise NotImplementedError("cross-attention layers are not supported by megatron_lite")


class TransformerLayer(nn.Module):
    """x + dropout(attn(norm(x))), then x + dropout(mlp(norm(x))). ``layer_number`` is global (1-based).

    Two ways to build one: upstream's ``TransformerLayer(config, submodules, layer_number,
    hidden_dropout, pg_collection)``, where the spec's ``mlp`` chooses a dense MLP or a MoELayer and
    unset groups are parallel_state's; or megatron_lite's ``TransformerLayer(config, layer_number,
    init_method=..., tp_group=..., ...)``, where ``config.moe_layer_freq`` chooses and no group is
    implied."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: TransformerLayerSubmodules | int | None = None,
        layer_number: int = 1,
        hidden_dropout: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        *,
        init_method=None,
        output_layer_init_method=None,
        tp_group=None,
        cp_group=None,
        seed: int = 1234,
    ):
        """``pg_collection`` and ``seed`` are for a MoE layer: its expert groups, and the key its
        experts' weights are drawn from (each expert by its global index)."""
        super().__init__()
        if isinstance(submodules, int):  # megatron_lite's positional form: (config, layer_number, ...)
            submodules, layer_number = None, submodules
        if submodules is not None:
            _check_supported(submodules)
            if pg_collection is None and tp_group is None and cp_group is None:
                pg_collection = get_default_pg_collection()
            if pg_collection is not None:
                tp_group = tp_group if tp_group is not None else pg_collection.tp
                cp_group = cp_group if cp_group is not None else pg_collection.cp
        init_method = init_method or config.init_method
        output_layer_init_method = output_layer_init_method or config.output_layer_init_method
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout if hidden_dropout is None else hidden_dropout
        self.sequence_parallel = config.sequence_parallel
        self.recompute_mlp = config.recompute_granularity == "selective" and "mlp" in config.recompute_modules
        self.input_layernorm = WrappedTorchNorm(config, config.hidden_size)
        self.self_attention = SelfAttention(
            config,
            init_method=init_method,
            output_layer_init_method=output_layer_init_method,
            tp_group=tp_group,
            cp_group=cp_group,
        )
        self.pre_mlp_layernorm = WrappedTorchNorm(config, config.hidden_size)
        if submodules is None:
            moe = is_moe_layer(config, layer_number)
        else:
            moe = isinstance(spec_module(submodules.mlp), type) and issubclass(
                spec_module(submodules.mlp), MoELayer
            )
        if moe:
            if pg_collection is None and (get_pg_size(tp_group) > 1 or get_pg_size(cp_group) > 1):
                # Without the expert groups a MoE layer would run as if it had no expert parallelism.
                raise ValueError("a MoE layer under tensor or context parallelism needs pg_collection")
            self.mlp = MoELayer(
                config,
                None if submodules is None else get_submodules(submodules.mlp),
                layer_number=layer_number,
                pg_collection=pg_collection or ProcessGroupCollection(tp=tp_group, cp=cp_group),
                seed=seed,
                init_method=init_method,
                output_layer_init_method=output_layer_init_method,
            )
        else:
            self.mlp = MLP(
                config,
                init_method=init_method,
                output_layer_init_method=output_layer_init_method,
                tp_group=tp_group,
            )

    def _mlp(self, normed: torch.Tensor) -> torch.Tensor:
        out = self.mlp(normed)
        return out[0] if isinstance(out, tuple) else out  # a spec-built MoELayer answers (output, bias)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.hidden_dropout if self.training else 0.0
        if p == 0.0:
            return x
        # Whole activations (alike on every TP rank) take the default stream; sequence-parallel shards
        # differ per rank, so they take the per-rank stream.
        fork = get_cuda_rng_tracker().fork() if self.sequence_parallel else contextlib.nullcontext()
        with fork:
            # The fused dropout CUDA runs for F.dropout and megatron-core's fused bias-dropout-add:
            # its bool mask is what backward keeps (1 byte an element; F.dropout on the CPU keeps a
            # scaled copy in the activations' dtype). The same random draws as F.dropout's.
            return torch.native_dropout(x, p, True)[0]

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """``packed_seq_params``: the examples of a packed row (attention stays within each)."""
        attention = self.self_attention(
            self.input_layernorm(hidden_states), rotary_pos_emb, packed_seq_params=packed_seq_params
        )
        hidden_states = hidden_states + self._dropout(attention)
        normed = self.pre_mlp_layernorm(hidden_states)
        if self.recompute_mlp and self.training:
            mlp = checkpoint(self._mlp, False, normed)
        else:
            mlp = self._mlp(normed)
        return hidden_states + self._dropout(mlp)
