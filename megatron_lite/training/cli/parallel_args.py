"""The parallel-layout flags a table row cannot map (config.flags has their rows): the virtual pipeline
size's aliases and the layout string."""

from __future__ import annotations

import argparse

from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron_lite.training.errors import ConfigError


def virtual_pipeline_from_args(args: argparse.Namespace, m) -> None:
    """--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank set the
    virtual pipeline size, as upstream: the first counts the embedding and loss as layers when they
    are accounted for in the split, and cannot describe an uneven first or last stage."""
    per_chunk, chunks = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    given = [
        flag
        for flag, value in (
            ("--virtual-pipeline-model-parallel-size", args.virtual_pipeline_model_parallel_size),
            ("--num-layers-per-virtual-pipeline-stage", per_chunk),
            ("--num-virtual-stages-per-pipeline-rank", chunks),
            ("--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(given[1], f"and {given[0]} set the same thing; give one")
    if args.pipeline_model_parallel_layout is not None:
        _layout_from_args(args.pipeline_model_parallel_layout, m)
    if chunks is not None:
        if chunks < 1:
            raise ConfigError(
                "--num-virtual-stages-per-pipeline-rank", f"must be a positive integer, got {chunks}"
            )
        m.virtual_pipeline_model_parallel_size = chunks
    if per_chunk is None:
        return
    flag = "--num-layers-per-virtual-pipeline-stage"
    if m.num_layers_in_first_pipeline_stage is not None or m.num_layers_in_last_pipeline_stage is not None:
        raise ConfigError(
            flag, "cannot describe an uneven first or last stage; use --num-virtual-stages-per-pipeline-rank"
        )
    pp = m.pipeline_model_parallel_size
    slots = (
        m.num_layers
        + int(m.account_for_embedding_in_pipeline_split)
        + int(m.account_for_loss_in_pipeline_split)
    )
    if per_chunk <= 0 or slots % (pp * per_chunk):
        raise ConfigError(
            flag, f"{per_chunk} does not divide the {slots} layers into chunks of every one of {pp} stages"
        )
    m.virtual_pipeline_model_parallel_size = slots // (pp * per_chunk)


def _layout_from_args(text: str, m) -> None:
    """--pipeline-model-parallel-layout, parsed for this pipeline size; its stages per rank set the
    virtual pipeline size (None for one, as upstream). Whether it holds the model's layers is the
    layer split's check."""
    flag, pp = "--pipeline-model-parallel-layout", m.pipeline_model_parallel_size
    try:
        layout = PipelineParallelLayerLayout(text, pp)
    except ValueError as err:
        raise ConfigError(flag, str(err)) from None
    m.pipeline_model_parallel_layout = layout
    vp = layout.virtual_pipeline_model_parallel_size
    m.virtual_pipeline_model_parallel_size = vp if vp > 1 else None
