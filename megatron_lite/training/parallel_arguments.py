"""Megatron-LM's parallel-layout flags (tensor, pipeline, context, virtual pipeline, the layer split and
the last stage's wgrad deferral), in arguments.py's (flag, section, field, type, help) form, and the
virtual pipeline size's aliases."""

from __future__ import annotations

import argparse

from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron_lite.training.config_errors import ConfigError

PARALLEL_FLAGS: list[tuple[str, str, str | None, object, str]] = [
    ("--tensor-model-parallel-size", "model", "tensor_model_parallel_size", int, "Tensor-parallel size."),
    (
        "--pipeline-model-parallel-size",
        "model",
        "pipeline_model_parallel_size",
        int,
        "Pipeline-parallel size.",
    ),
    ("--context-parallel-size", "model", "context_parallel_size", int, "Context-parallel size."),
    (
        "--virtual-pipeline-model-parallel-size",
        "model",
        "virtual_pipeline_model_parallel_size",
        int,
        "Model chunks per pipeline rank (interleaved 1F1B).",
    ),
    (
        "--num-layers-per-virtual-pipeline-stage",
        "model",
        None,
        int,
        "Layers per model chunk, the embedding and loss counted when accounted for in the split "
        "(sets --virtual-pipeline-model-parallel-size).",
    ),
    (
        "--num-virtual-stages-per-pipeline-rank",
        "model",
        None,
        int,
        "Model chunks per pipeline rank (sets --virtual-pipeline-model-parallel-size).",
    ),
    (
        "--pipeline-model-parallel-layout",
        "model",
        "pipeline_model_parallel_layout",
        str,
        "Every stage's layers, e.g. 'Ett|(tt|)*2,tL': E embedding, t layer, L loss, | between stages "
        "(sets --virtual-pipeline-model-parallel-size).",
    ),
    (
        "--decoder-first-pipeline-num-layers",
        "model",
        "num_layers_in_first_pipeline_stage",
        int,
        "Transformer layers on the first pipeline stage (default: an even split).",
    ),
    (
        "--decoder-last-pipeline-num-layers",
        "model",
        "num_layers_in_last_pipeline_stage",
        int,
        "Transformer layers on the last pipeline stage (default: an even split).",
    ),
    (
        "--account-for-embedding-in-pipeline-split",
        "model",
        "account_for_embedding_in_pipeline_split",
        "store_true",
        "Count the embedding as a layer when splitting the layers over stages.",
    ),
    (
        "--account-for-loss-in-pipeline-split",
        "model",
        "account_for_loss_in_pipeline_split",
        "store_true",
        "Count the loss as a layer when splitting the layers over stages.",
    ),
    (
        "--defer-embedding-wgrad-compute",
        "model",
        "defer_embedding_wgrad_compute",
        "store_true",
        "Run the last stage's output-layer weight-gradient GEMMs at the pipeline flush.",
    ),
    (
        "--wgrad-deferral-limit",
        "model",
        "wgrad_deferral_limit",
        int,
        "Microbatches whose output-layer wgrad is deferred (0: all).",
    ),
    (
        "--microbatch-group-size-per-virtual-pipeline-stage",
        "model",
        "microbatch_group_size_per_vp_stage",
        int,
        "Consecutive microbatches per chunk (default: pp).",
    ),
]


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
