"""Megatron-LM's command-line flags: the one table that maps each flag onto a config field.

``training.arguments`` builds the parser from it and copies each given value onto its field (the flags
whose field is None it maps itself, with ``data_arguments`` and ``parallel_arguments``); ``ranges``
holds each numeric flag's allowed values, checked first by ``ConfigContainer.validate``.
"""

from __future__ import annotations

from megatron_lite.training.config.data_flags import DATA_FLAGS
from megatron_lite.training.config.logging_flags import LOGGING_FLAGS
from megatron_lite.training.config.moe_flags import MOE_FLAGS
from megatron_lite.training.config.parallel_flags import PARALLEL_FLAGS

# (flag, section, field, type, help). type is a callable, "store_true", "store_false", "+" (a list of
# strings) or [callable] (a list of that type); a field of None marks a flag that config_from_args maps
# itself (it sets other fields).
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
    (
        "--use-rope-scaling",
        "model",
        "rope_scaling",
        "store_true",
        "Llama 3.x's rotary frequency scaling (with --position-embedding-type rope).",
    ),
    ("--rope-scaling-factor", "model", "rope_scaling_factor", float, "Llama 3.x's rope scaling factor."),
    ("--swiglu", "model", "gated_linear_unit", "store_true", "Gated SiLU MLP (SwiGLU)."),
    ("--squared-relu", "model", None, "store_true", "relu(x)^2 activation."),
    ("--openai-gelu", "model", None, "store_true", "GELU's tanh approximation (GPT-2's gelu_new)."),
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
        "--cross-entropy-loss-fusion",
        "model",
        "cross_entropy_loss_fusion",
        "store_true",
        "The output layer and the cross entropy over chunks of tokens: no [s, b, vocab/tp] logits.",
    ),
    (
        "--no-gradient-accumulation-fusion",
        "model",
        "gradient_accumulation_fusion",
        "store_false",
        "Linear layers return a weight-sized gradient for DDP to add into main_grad.",
    ),
    (
        "--cross-entropy-fusion-impl",
        "model",
        "cross_entropy_fusion_impl",
        str,
        "native (chunked, megatron_lite's); te is not supported.",
    ),
    (
        "--cross-entropy-fusion-chunk-tokens",
        "model",
        "cross_entropy_fusion_chunk_tokens",
        int,
        "Tokens per chunk of the fused loss (default: the device's).",
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
    *MOE_FLAGS,
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
    ("--start-weight-decay", "scheduler", "start_weight_decay", float, "Weight decay at the start."),
    ("--end-weight-decay", "scheduler", "end_weight_decay", float, "Weight decay at the end."),
    ("--weight-decay-incr-style", "scheduler", "weight_decay_incr_style", str, "constant, linear, cosine."),
    (
        "--override-opt-param-scheduler",
        "scheduler",
        "override_opt_param_scheduler",
        "store_true",
        "On resume, this run's schedule, not the checkpoint's.",
    ),
    (
        "--use-checkpoint-opt-param-scheduler",
        "scheduler",
        "use_checkpoint_opt_param_scheduler",
        "store_true",
        "On resume, the checkpoint's schedule.",
    ),
    # Data, tokenizer and seeds
    *DATA_FLAGS,
    ("--seed", "rng", "seed", int, "Random seed (weights and data)."),
    *LOGGING_FLAGS,
    # Checkpoints
    ("--save", "checkpoint", "save", str, "Checkpoint directory to save to."),
    ("--save-interval", "checkpoint", "save_interval", int, "Iterations between saves."),
    ("--load", "checkpoint", "load", str, "Checkpoint directory to resume from."),
    ("--no-load-optim", "checkpoint", "load_optim", "store_false", "Do not load optimizer state."),
    ("--no-load-rng", "checkpoint", "load_rng", "store_false", "Do not load RNG state."),
    ("--finetune", "checkpoint", "finetune", "store_true", "Load weights only; reset the iteration."),
    ("--ckpt-step", "checkpoint", "ckpt_step", int, "Load this iteration of --load, not the latest."),
    (
        "--pretrained-checkpoint",
        "checkpoint",
        "pretrained_checkpoint",
        str,
        "Finetune from this checkpoint when --load holds none.",
    ),
    (
        "--use-checkpoint-args",
        "checkpoint",
        None,
        "store_true",
        "Take the model's architecture from the checkpoint to load (--load, else --pretrained-checkpoint).",
    ),
    (
        "--load-main-params-from-ckpt",
        "checkpoint",
        "load_main_params_from_ckpt",
        "store_true",
        "With --no-load-optim: fp32 main params from the checkpoint's weights.",
    ),
    (
        "--ckpt-format",
        "checkpoint",
        "ckpt_format",
        str,
        "Format to save: torch (legacy, default) or torch_dist (loadable at any layout); loads detect it.",
    ),
    (
        "--async-save",
        "checkpoint",
        "async_save",
        "store_true",
        "torch_dist only: write checkpoints from a background process while training goes on.",
    ),
    # Launch
    ("--nproc-per-node", "dist", "nproc_per_node", int, "Worker processes (default tp x pp x cp)."),
    ("--distributed-backend", "dist", "distributed_backend", str, "gloo or nccl (default: by hardware)."),
    ("--distributed-timeout-minutes", "dist", "distributed_timeout_minutes", int, "Collective timeout."),
]

# Upstream flags whose features are not built yet: parsed, then refused if given.
UNSUPPORTED_FLAGS: dict[str, object] = {
    "--use-flash-attn": "store_true",
}
