"""The layers one pipeline stage owns, plus the final norm on the last stage."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.packed_seq_params import PackedSeqParams
from megatron_lite.core.tensor_parallel.random import checkpoint
from megatron_lite.core.transformer.moe.moe_utils import get_default_pg_collection
from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.core.transformer.spec_utils import ModuleSpec, get_submodules
from megatron_lite.core.transformer.torch_norm import WrappedTorchNorm
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron_lite.core.utils import seeded_init


def get_num_layers_to_build(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> int:
    """Transformer layers in model chunk ``vp_stage`` of pipeline stage ``pp_rank`` (this process's
    stage when None), by Megatron's split (``pipeline_layer_split``)."""
    if pp_rank is None:
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    return pipeline_layer_counts(config)[vp_stage or 0][pp_rank]


@dataclass
class TransformerBlockSubmodules:
    """A block's layer specs (this stage's layers, in order) and its final norm (upstream's fields;
    megatron_lite's final norm follows ``config.normalization``)."""

    layer_specs: list | None = None
    layer_norm: object = None


def _layer_specs(config: TransformerConfig, spec, num_layers: int) -> list:
    """This stage's ``num_layers`` layer specs from a block spec, or one layer spec for every layer."""
    if isinstance(spec, TransformerBlockSubmodules):
        specs = spec.layer_specs
    elif isinstance(spec, ModuleSpec) and issubclass(spec.module, TransformerBlock):
        specs = spec.submodules.layer_specs
    elif isinstance(spec, ModuleSpec) and issubclass(spec.module, TransformerLayer):
        specs = [spec] * num_layers
    else:
        raise ValueError(f"Unsupported transformer block spec: {spec!r}")
    if len(specs) != num_layers:
        raise ValueError(f"the block spec has {len(specs)} layer specs for this stage's {num_layers} layers")
    return specs


class TransformerBlock(nn.Module):
    """This stage's layers and, with ``post_process``, the final norm. ``spec`` (upstream's block or
    layer spec) chooses each layer's MLP (dense or MoE); without it ``config.moe_layer_freq`` does.
    With a spec, groups and the pipeline rank left unset are parallel_state's."""

    def __init__(
        self,
        config: TransformerConfig,
        spec=None,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        pg_collection=None,
        vp_stage: int | None = None,
        *,
        pp_rank: int | None = 0,
        seed: int = 1234,
        tp_group=None,
        cp_group=None,
    ):
        super().__init__()
        self.config = config
        if spec is not None:
            pp_rank = (
                parallel_state.get_pipeline_model_parallel_rank() if parallel_state.is_initialized() else 0
            )
            if pg_collection is None and tp_group is None and cp_group is None:
                pg_collection = get_default_pg_collection()
            if pg_collection is not None:
                tp_group = tp_group if tp_group is not None else pg_collection.tp
                cp_group = cp_group if cp_group is not None else pg_collection.cp
        num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        specs = [None] * num_layers if spec is None else _layer_specs(config, spec, num_layers)
        init, scaled = config.init_method, config.output_layer_init_method
        layers = []
        for i, layer_spec in zip(range(offset, offset + num_layers), specs, strict=True):
            with seeded_init(seed, f"layer {i}"):
                layers.append(
                    TransformerLayer(
                        config,
                        None if layer_spec is None else get_submodules(layer_spec),
                        i + 1,
                        init_method=init,
                        output_layer_init_method=scaled,
                        tp_group=tp_group,
                        cp_group=cp_group,
                        pg_collection=pg_collection,
                        seed=seed,
                    )
                )
        self.layers = nn.ModuleList(layers)
        final_norm = post_process and post_layer_norm
        self.final_layernorm = WrappedTorchNorm(config, config.hidden_size) if final_norm else None

    def _run_layers(self, start: int, end: int, packed_seq_params: PackedSeqParams | None = None):
        # The boundaries go in by closure (as upstream's custom forward): checkpoints save tensors only.
        def run(hidden_states, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, rotary_pos_emb, packed_seq_params=packed_seq_params)
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, rotary_pos_emb, packed_seq_params=None):
        """Full recomputation, Megatron's two methods over this stage's layers: ``uniform`` keeps only
        the input of each chunk of ``recompute_num_layers`` layers; ``block`` recomputes the first
        ``recompute_num_layers`` layers one by one and keeps the rest's activations."""
        c = self.config
        count, n = len(self.layers), c.recompute_num_layers
        # Sequence-parallel inputs are already split over TP: nothing left to distribute.
        distribute = c.distribute_saved_activations and not c.sequence_parallel
        if c.recompute_method == "uniform":
            for start in range(0, count, n):
                run = self._run_layers(start, min(start + n, count), packed_seq_params)
                hidden_states = checkpoint(run, distribute, hidden_states, rotary_pos_emb)
            return hidden_states
        for i in range(count):
            run = self._run_layers(i, i + 1, packed_seq_params)
            if i < n:
                hidden_states = checkpoint(run, distribute, hidden_states, rotary_pos_emb)
            else:
                hidden_states = run(hidden_states, rotary_pos_emb)
        return hidden_states

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """``attention_mask`` (upstream's argument) is not read: megatron_lite's attention is causal,
        within each example of a packed row when ``packed_seq_params`` is given."""
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states, rotary_pos_emb, packed_seq_params)
        else:
            run = self._run_layers(0, len(self.layers), packed_seq_params)
            hidden_states = run(hidden_states, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
