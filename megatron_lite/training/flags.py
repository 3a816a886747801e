"""Megatron-LM's command-line flags: the one table that maps each flag onto a config field.

``arguments`` builds the parser from it and copies each given value onto its field; ``flag_ranges``
holds each numeric flag's allowed values, checked by ``ConfigContainer.validate``. Data and parallel
layout flags are kept beside the code that maps them (``data_arguments``, ``parallel_arguments``) and
spliced in here.
"""

from __future__ import annotations

from megatron_lite.training.data_arguments import DATA_FLAGS
from megatron_lite.training.parallel_arguments import PARALLEL_FLAGS

# (flag, section, field, type, help). type is a callable, "store_true", "store_false" or "+" (a list of
# strings); a field of
# None marks a flag that config_from_args maps itself (it sets other fields).
FLAGS: list[tuple[str, str, str, object, str]] = [
    # Model
    ("--num-layers", "model", "num_layers", int, "Transformer layers."),
    ("--hidden-size", "model", "hidden_size", int, "Hidden size."),
    ("--num-attention-heads", "model", "num_attention_heads", int, "Attention heads."),
    ("--ffn-hidden-size", "model", "ffn_hidden_size", int, "MLP hidden size (default 4 x hidden)."),
    ("--kv-channels", "model", "kv_channels", int, "Projection size per head (default hidden / heads)."),
    ("--seq-length", "dataset", "seq_length", int, "Tokens per sample."),
    ("--max-position-embeddings", "model", "max_position_embeddings", int, "Position-embedding rows."),
    ("--vocab-size", "model", "vocab_size", int, "Vocabulary size (mock data; a NullTokenizer's)."),
    (
        "--make-vocab-size-divisible-by",
        "model",
        "make_vocab_size_divisible_by",
        int,
        "Vocab padding multiple.",
    ),
    ("--init-method-std", "model", "init_method_std", float, "Std of the normal weight init."),
    ("--norm-epsilon", "model", "layernorm_epsilon", float, "Epsilon of LayerNorm / RMSNorm."),
    ("--layernorm-epsilon", "model", "layernorm_epsilon", float, "Older name of --norm-epsilon."),
    ("--normalization", "model", "normalization", str, "LayerNorm or RMSNorm."),
    (
        "--position-embedding-type",
        "model",
        "position_embedding_type",
        str,
        "learned_absolute, rope or none.",
    ),
    ("--rotary-percent", "model", "rotary_percent", float, "Fraction of head channels rotated."),
    ("--rotary-base", "model", "rotary_base", int, "Base of the rotary frequencies."),
    (
        "--rotary-interleaved",
        "model",
        "rotary_interleaved",
        "store_true",
        "Rotate adjacent channel pairs, not halves.",
    ),
    (
        "--rotary-seq-len-interpolation-factor",
        "model",
        "seq_len_interpolation_factor",
        int,
        "Divide rotary positions by this factor.",
    ),
    ("--swiglu", "model", "gated_linear_unit", "store_true", "Gated SiLU MLP (SwiGLU)."),
    ("--squared-relu", "model", None, "store_true", "relu(x)^2 activation."),
    (
        "--group-query-attention",
        "model",
        None,
        "store_true",
        "Grouped-query attention (with --num-query-groups).",
    ),
    ("--num-query-groups", "model", "num_query_groups", int, "Key/value head groups."),
    ("--add-qkv-bias", "model", "add_qkv_bias", "store_true", "QKV bias even with --disable-bias-linear."),
    ("--hidden-dropout", "model", "hidden_dropout", float, "Dropout before each residual add."),
    ("--attention-dropout", "model", "attention_dropout", float, "Dropout on attention probabilities."),
    (
        "--untie-embeddings-and-output-weights",
        "model",
        "share_embeddings_and_output_weights",
        "store_false",
        "Give the output layer its own weight.",
    ),
    ("--disable-bias-linear", "model", "add_bias_linear", "store_false", "No biases in linear layers."),
    ("--bf16", "model", "bf16", "store_true", "bf16 compute, fp32 master weights."),
    ("--fp16", "model", "fp16", "store_true", "fp16 compute (not supported yet)."),
    (
        "--sequence-parallel",
        "model",
        "sequence_parallel",
        "store_true",
        "Split norms and dropout along the sequence over TP ranks (needs tp > 1).",
    ),
    ("--recompute-granularity", "model", "recompute_granularity", str, "full or selective."),
    ("--recompute-method", "model", "recompute_method", str, "uniform or block (with full)."),
    ("--recompute-num-layers", "model", "recompute_num_layers", int, "Layers per chunk / per stage."),
    (
        "--recompute-activations",
        "model",
        None,
        "store_true",
        "Selective recomputation (--recompute-granularity selective).",
    ),
    (
        "--distribute-saved-activations",
        "model",
        "distribute_saved_activations",
        "store_true",
        "Split recomputed chunks' inputs over TP ranks.",
    ),
    ("--recompute-modules", "model", "recompute_modules", "+", "Selective: core_attn and/or mlp."),
    *PARALLEL_FLAGS,
    # Training
    (
        "--micro-batch-size",
        "train",
        "micro_batch_size",
        int,
        "Samples per microbatch per data-parallel rank.",
    ),
    ("--global-batch-size", "train", "global_batch_size", int, "Samples per iteration."),
    ("--train-iters", "train", "train_iters", int, "Iterations to train."),
    ("--train-samples", "train", "train_samples", int, "Samples to train (instead of --train-iters)."),
    ("--exit-interval", "train", "exit_interval", int, "Exit when the iteration is a multiple of this."),
    (
        "--exit-signal-handler",
        "train",
        "exit_signal_handler",
        "store_true",
        "On SIGTERM finish the iteration, save and exit 0.",
    ),
    ("--eval-interval", "validation", "eval_interval", int, "Iterations between validations."),
    ("--eval-iters", "validation", "eval_iters", int, "Iterations per validation."),
    # Optimizer and schedule
    ("--lr", "optimizer", "lr", float, "Peak learning rate."),
    ("--min-lr", "optimizer", "min_lr", float, "Final learning rate."),
    ("--weight-decay", "optimizer", "weight_decay", float, "Weight decay."),
    ("--adam-beta1", "optimizer", "adam_beta1", float, "Adam beta1."),
    ("--adam-beta2", "optimizer", "adam_beta2", float, "Adam beta2."),
    ("--adam-eps", "optimizer", "adam_eps", float, "Adam epsilon."),
    ("--clip-grad", "optimizer", "clip_grad", float, "Global grad-norm clip (0 disables)."),
    (
        "--use-distributed-optimizer",
        "optimizer",
        "use_distributed_optimizer",
        "store_true",
        "Shard optimizer state over data-parallel ranks.",
    ),
    ("--overlap-grad-reduce", "ddp", "overlap_grad_reduce", "store_true", "Overlap grad reduction."),
    ("--overlap-param-gather", "ddp", "overlap_param_gather", "store_true", "Overlap param all-gather."),
    ("--ddp-bucket-size", "ddp", "bucket_size", int, "Parameters per reduction bucket."),
    ("--lr-decay-style", "scheduler", "lr_decay_style", str, "constant, linear or cosine."),
    ("--lr-decay-iters", "scheduler", "lr_decay_iters", int, "Decay iterations (default train-iters)."),
    ("--lr-warmup-iters", "scheduler", "lr_warmup_iters", int, "Warmup iterations."),
    ("--lr-decay-samples", "scheduler", "lr_decay_samples", int, "Decay samples (with --train-samples)."),
    ("--lr-warmup-samples", "scheduler", "lr_warmup_samples", int, "Warmup samples (with --train-samples)."),
    ("--lr-warmup-fraction", "scheduler", "lr_warmup_fraction", float, "Warmup as a fraction of decay."),
    ("--lr-warmup-init", "scheduler", "lr_warmup_init", float, "Learning rate at the start of warmup."),
    # Data, tokenizer and seeds
    *DATA_FLAGS,
    ("--seed", "rng", "seed", int, "Random seed (weights and data)."),
    # Logging
    ("--log-interval", "logger", "log_interval", int, "Iterations between console lines."),
    ("--log-throughput", "logger", "log_throughput", "store_true", "Print model TFLOP/s per GPU."),
    (
        "--log-throughput-to-tensorboard",
        "logger",
        "log_throughput_to_tensorboard",
        "store_true",
        "Log throughput/* (windowed batches, samples, tokens per second; TFLOP/s) to the loggers.",
    ),
    ("--throughput-window-size", "logger", "throughput_window_size", int, "Iterations in the window."),
    ("--timing-log-level", "logger", "timing_log_level", int, "Timers to log: 0 none, 1 step, 2 all."),
    ("--log-params-norm", "logger", "log_params_norm", "store_true", "Compute and log the parameter norm."),
    ("--tensorboard-dir", "logger", "tensorboard_dir", str, "TensorBoard directory."),
    (
        "--tensorboard-log-interval",
        "logger",
        "tensorboard_log_interval",
        int,
        "Iterations between logger writes.",
    ),
    ("--tensorboard-queue-size", "logger", "tensorboard_queue_size", int, "SummaryWriter queue size."),
    ("--log-timers-to-tensorboard", "logger", "log_timers_to_tensorboard", "store_true", "Log timers."),
    (
        "--log-memory-to-tensorboard",
        "logger",
        "log_memory_to_tensorboard",
        "store_true",
        "Log memory: each metric's peak across all pipeline stages.",
    ),
    (
        "--log-memory-per-pp-stage",
        "logger",
        "log_memory_per_pp_stage",
        "store_true",
        "Also log memory/pp-stage-<i>/<name> for every stage.",
    ),
    (
        "--no-log-loss-scale-to-tensorboard",
        "logger",
        "log_loss_scale_to_tensorboard",
        "store_false",
        "Do not log the loss scale.",
    ),
    ("--wandb-project", "logger", "wandb_project", str, "W&B project."),
    ("--wandb-exp-name", "logger", "wandb_exp_name", str, "W&B run name."),
    ("--wandb-save-dir", "logger", "wandb_save_dir", str, "W&B local directory."),
    ("--wandb-entity", "logger", "wandb_entity", str, "W&B entity."),
    ("--mlflow-experiment", "logger", "mlflow_experiment", str, "MLflow experiment."),
    ("--mlflow-run-name", "logger", "mlflow_run_name", str, "MLflow run name."),
    ("--mlflow-tracking-uri", "logger", "mlflow_tracking_uri", str, "MLflow tracking URI."),
    ("--comet-project", "logger", "comet_project", str, "Comet project."),
    ("--comet-experiment-name", "logger", "comet_experiment_name", str, "Comet experiment name."),
    ("--comet-workspace", "logger", "comet_workspace", str, "Comet workspace."),
    ("--comet-offline-directory", "logger", "comet_offline_directory", str, "Write Comet offline here."),
    # Checkpoints
    ("--save", "checkpoint", "save", str, "Checkpoint directory to save to."),
    ("--save-interval", "checkpoint", "save_interval", int, "Iterations between saves."),
    ("--load", "checkpoint", "load", str, "Checkpoint directory to resume from."),
    ("--no-load-optim", "checkpoint", "load_optim", "store_false", "Do not load optimizer state."),
    ("--no-load-rng", "checkpoint", "load_rng", "store_false", "Do not load RNG state."),
    ("--finetune", "checkpoint", "finetune", "store_true", "Load weights only; reset the iteration."),
    ("--ckpt-format", "checkpoint", "ckpt_format", str, "Checkpoint format (only torch so far)."),
    # Launch
    ("--nproc-per-node", "dist", "nproc_per_node", int, "Worker processes (default tp x pp x cp)."),
    ("--distributed-backend", "dist", "distributed_backend", str, "gloo or nccl (default: by hardware)."),
    ("--distributed-timeout-minutes", "dist", "distributed_timeout_minutes", int, "Collective timeout."),
]

# Profiler flags (config.profiling, None unless --profile): (flag, field, type, help).
PROFILING_FLAGS: list[tuple[str, str, object, str]] = [
    ("--use-pytorch-profiler", "use_pytorch_profiler", "store_true", "torch.profiler, not Nsight Systems."),
    ("--profile-step-start", "profile_step_start", int, "Global step to start profiling (default: 10)."),
    ("--profile-step-end", "profile_step_end", int, "Global step to stop profiling (default: 12)."),
    ("--profile-ranks", "profile_ranks", "+", "Global ranks to profile (default: 0)."),
    ("--pytorch-profiler-collect-shapes", "pytorch_profiler_collect_shapes", "store_true", "Record shapes."),
    ("--pytorch-profiler-collect-callstack", "pytorch_profiler_collect_callstack", "store_true", "Stacks."),
    ("--pytorch-profiler-collect-chakra", "pytorch_profiler_collect_chakra", "store_true", "Chakra traces."),
    ("--record-shapes", "record_shapes", "store_true", "Shapes in Nsight Systems' NVTX ranges."),
]

# Upstream flags whose features are not built yet: parsed, then refused if given.
UNSUPPORTED_FLAGS: dict[str, object] = {
    "--expert-model-parallel-size": int,
    "--num-experts": int,
    "--use-flash-attn": "store_true",
}
