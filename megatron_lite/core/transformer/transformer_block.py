"""The layers one pipeline stage owns, plus the final norm on the last stage."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.tensor_parallel.random import checkpoint
from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
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


class TransformerBlock(nn.Module):
    def __init__(
        self,
        config: TransformerConfig,
        *,
        pp_rank: int = 0,
        vp_stage: int | None = None,
        post_process: bool = True,
        seed: int = 1234,
        tp_group=None,
        cp_group=None,
        pg_collection=None,
    ):
        super().__init__()
        self.config = config
        num_layers = get_num_layers_to_build(config, vp_stage, pp_rank)
        offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
        init, scaled = config.init_method, config.output_layer_init_method
        layers = []
        for i in range(offset, offset + num_layers):
            with seeded_init(seed, f"layer {i}"):
                layers.append(
                    TransformerLayer(
                        config,
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
        self.final_layernorm = WrappedTorchNorm(config, config.hidden_size) if post_process else None

    def _run_layers(self, start: int, end: int):
        def run(hidden_states, rotary_pos_emb):
            for layer in self.layers[start:end]:
                hidden_states = layer(hidden_states, rotary_pos_emb)
            return hidden_states

        return run

    def _checkpointed_forward(self, hidden_states, rotary_pos_emb):
        """Full recomputation, Megatron's two methods over this stage's layers: ``uniform`` keeps only
        the input of each chunk of ``recompute_num_layers`` layers; ``block`` recomputes the first
        ``recompute_num_layers`` layers one by one and keeps the rest's activations."""
        c = self.config
        count, n = len(self.layers), c.recompute_num_layers
        # Sequence-parallel inputs are already split over TP: nothing left to distribute.
        distribute = c.distribute_saved_activations and not c.sequence_parallel
        if c.recompute_method == "uniform":
            for start in range(0, count, n):
                run = self._run_layers(start, min(start + n, count))
                hidden_states = checkpoint(run, distribute, hidden_states, rotary_pos_emb)
            return hidden_states
        for i in range(count):
            run = self._run_layers(i, i + 1)
            if i < n:
                hidden_states = checkpoint(run, distribute, hidden_states, rotary_pos_emb)
            else:
                hidden_states = run(hidden_states, rotary_pos_emb)
        return hidden_states

    def forward(
        self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.config.recompute_granularity == "full" and self.training:
            hidden_states = self._checkpointed_forward(hidden_states, rotary_pos_emb)
        else:
            hidden_states = self._run_layers(0, len(self.layers))(hidden_states, rotary_pos_emb)
        if self.final_layernorm is not None:
            hidden_states = self.final_layernorm(hidden_states)
        return hidden_states
