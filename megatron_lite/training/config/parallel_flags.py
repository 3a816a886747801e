"""Megatron-LM's parallel-layout flags, a part of the one flag table (flags.py joins them in)."""

from __future__ import annotations

# Megatron-LM's parallel-layout flags (tensor, pipeline, context, virtual pipeline, the layer split and the
# last stage's wgrad deferral); a field of None is mapped by arguments.virtual_pipeline_from_args.
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
