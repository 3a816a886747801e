"""Megatron-LM command-line flags, parsed onto a validated ConfigContainer.

Each flag maps to one config field; its help text is the field's docstring default. Flags of upstream
features not built yet are accepted by the parser but refused with a clear "not supported yet" error,
never silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
import warnings

import torch.nn.functional as F

from megatron_lite.core.activations import squared_relu
from megatron_lite.training.config import ConfigContainer, ConfigError
from megatron_lite.training.config_sections import ProfilingConfig
from megatron_lite.training.data_arguments import DATA_FLAGS, dataset_from_args, prepare_dataset_section
from megatron_lite.training.parallel_arguments import PARALLEL_FLAGS, virtual_pipeline_from_args

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


class _Parser(argparse.ArgumentParser):
    def parse_args(self, args=None, namespace=None):
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            options = [s for action in self._actions for s in action.option_strings]
            first = unknown[0]
            match = difflib.get_close_matches(first.split("=")[0], options, n=1)
            hint = f" (did you mean {match[0]}?)" if match else ""
            self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
        return namespace

    def error(self, message: str):
        # One line, like every other input error, instead of argparse's screens of usage.
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pretrain.py",
        allow_abbrev=False,
        description="Pretrain a GPT with megatron_lite (Megatron-LM flag names).",
    )
    defaults = ConfigContainer()
    groups: dict[str, argparse._ArgumentGroup] = {}
    metavars = {int: "N", float: "X", str: "S"}
    for flag, section, name, kind, help_text in FLAGS:
        group = groups.setdefault(section, parser.add_argument_group(f"{section} (config.{section})"))
        dest = flag[2:].replace("-", "_")
        if kind in ("store_true", "store_false"):
            group.add_argument(flag, dest=dest, action=kind, default=None, help=help_text)
        elif kind == "+":
            group.add_argument(flag, dest=dest, nargs="+", default=None, metavar="S", help=help_text)
        else:
            default = getattr(getattr(defaults, section), name) if name else None
            group.add_argument(
                flag,
                dest=dest,
                type=kind,
                default=None,
                metavar=metavars[kind],
                help=help_text if "default" in help_text else f"{help_text} (default: {default})",
            )
    profiling = parser.add_argument_group("profiling (config.profiling)")
    profiling.add_argument(
        "--profile", action="store_true", help="Profile (Nsight Systems, or torch.profiler)."
    )
    for flag, _name, kind, help_text in PROFILING_FLAGS:
        dest = flag[2:].replace("-", "_")
        if kind == "store_true":
            profiling.add_argument(flag, dest=dest, action=kind, default=None, help=help_text)
        else:
            nargs, kind = ("+", int) if kind == "+" else (None, kind)
            profiling.add_argument(flag, dest=dest, type=kind, nargs=nargs, metavar="N", help=help_text)
    preflight = parser.add_argument_group("memory preflight (predict, build nothing, train nothing)")
    preflight.add_argument(
        "--memory-preflight",
        action="store_true",
        help="Print each stage's predicted memory, the stage that runs out first and the cheapest fix; exit.",
    )
    preflight.add_argument(
        "--device-memory-gb", type=float, metavar="GB", help="The GPU's memory (preflight)."
    )
    # As upstream, memory history is independent of --profile.
    profiling.add_argument(
        "--record-memory-history",
        action="store_true",
        help="Record the CUDA allocator's history; snapshots to --memory-snapshot-path (CUDA only).",
    )
    profiling.add_argument(
        "--memory-snapshot-path",
        default=None,
        metavar="FILE",
        help="Snapshot file (default: snapshot.pickle).",
    )
    for flag, kind in UNSUPPORTED_FLAGS.items():
        dest = "unsupported_" + flag[2:].replace("-", "_")
        if kind == "store_true":
            parser.add_argument(flag, dest=dest, action="store_true", help=argparse.SUPPRESS)
        else:
            parser.add_argument(
                flag,
                dest=dest,
                nargs=kind if kind == "+" else None,
                type=None if kind == "+" else kind,
                help=argparse.SUPPRESS,
            )
    return parser


def config_from_args(args: argparse.Namespace) -> ConfigContainer:
    """Map parsed flags onto a ConfigContainer (not yet validated)."""
    for flag in UNSUPPORTED_FLAGS:
        value = getattr(args, "unsupported_" + flag[2:].replace("-", "_"))
        if value not in (None, False):
            raise ConfigError(flag, "is not supported yet by megatron_lite")
    config = ConfigContainer()
    prepare_dataset_section(args, config)
    for flag, section, name, _kind, _help in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and name is not None:
            setattr(getattr(config, section), name, value)
    dataset_from_args(args, config)
    config.profiling = _profiling_from_args(args)
    if args.memory_preflight or args.device_memory_gb is not None:
        raise ConfigError(
            "--memory-preflight", "is a mode of pretrain.py: give it with --device-memory-gb GB"
        )
    t, m = config.train, config.model
    _architecture_from_args(args, m)
    if args.train_samples is not None and args.train_iters is None:
        t.train_iters = None  # the demo's default length gives way to --train-samples
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # as pretrain.py decides
    if config.dist.nproc_per_node is None and not under_torchrun:
        # pretrain.py launches the workers itself: by default one per model-parallel rank.
        config.dist.nproc_per_node = config.model_parallel_size
    if args.ffn_hidden_size is None:
        # SwiGLU's two input matrices: 2/3 of 4 h keeps the MLP's parameters, rounded down to 64 (upstream).
        m.ffn_hidden_size = int(4 * m.hidden_size * 2 / 3 / 64) * 64 if args.swiglu else 4 * m.hidden_size
    if args.kv_channels is None:
        m.kv_channels = m.hidden_size // max(m.num_attention_heads, 1)
    if args.max_position_embeddings is None:
        m.max_position_embeddings = max(m.max_position_embeddings or 0, config.dataset.seq_length)
    m.seq_length = config.dataset.seq_length
    config.dataset.random_seed = config.rng.seed
    config.optimizer.bf16, config.optimizer.fp16 = m.bf16, m.fp16
    lg = config.logger
    torch_profiler = config.profiling is not None and config.profiling.use_pytorch_profiler
    if lg.tensorboard_dir is None and (
        lg.log_memory_to_tensorboard or lg.log_timers_to_tensorboard or torch_profiler
    ):
        # A TensorBoard flag without a directory still logs, somewhere the user is told about.
        lg.tensorboard_dir = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"), "tensorboard")
    return config


def _architecture_from_args(args: argparse.Namespace, m) -> None:
    """The flags that set more than one model field: activations, grouped-query attention,
    --recompute-activations (upstream's alias of --recompute-granularity selective) and the
    virtual pipeline size's aliases."""
    virtual_pipeline_from_args(args, m)
    if args.recompute_activations:
        if m.recompute_granularity not in (None, "selective"):
            raise ConfigError("--recompute-activations", "means --recompute-granularity selective; give one")
        m.recompute_granularity = "selective"
    if args.swiglu:
        m.activation_func = F.silu
    if args.squared_relu:
        if args.swiglu:
            raise ConfigError("--squared-relu", "cannot be combined with --swiglu; choose one activation")
        m.activation_func = squared_relu
    if args.group_query_attention and args.num_query_groups is None:
        raise ConfigError("--group-query-attention", "needs --num-query-groups G")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ConfigError("--num-query-groups", "needs --group-query-attention (upstream ignores it without)")


def _profiling_from_args(args: argparse.Namespace) -> ProfilingConfig | None:
    """config.profiling from the flags: None without --profile, whose sub-flags then are refused
    (upstream would ignore them silently)."""
    given = {name: getattr(args, f[2:].replace("-", "_")) for f, name, _k, _h in PROFILING_FLAGS}
    given = {name: value for name, value in given.items() if value is not None}
    history = {"record_memory_history": True} if args.record_memory_history else {}
    if args.memory_snapshot_path is not None:
        if not args.record_memory_history:
            raise ConfigError("--memory-snapshot-path", "needs --record-memory-history")
        history["memory_snapshot_path"] = args.memory_snapshot_path
    if not args.profile:
        if given:
            flag = next(f for f, name, _k, _h in PROFILING_FLAGS if name in given)
            raise ConfigError(flag, "needs --profile")
        return ProfilingConfig(use_nsys_profiler=False, **history) if history else None
    torch_profiler = given.pop("use_pytorch_profiler", False)
    return ProfilingConfig(
        use_pytorch_profiler=torch_profiler, use_nsys_profiler=not torch_profiler, **given, **history
    )


def config_from_argv(argv: list[str] | None) -> ConfigContainer:
    """Parse and validate; bad values raise ConfigError (argparse itself still exits on unknown flags).
    The mapping and validate() warn about values they adjust, as upstream."""
    args = build_parser().parse_args(argv)
    config = config_from_args(args)
    config.validate()
    return config


def parse_args(argv: list[str] | None = None) -> ConfigContainer:
    """Parse and validate. Bad input: one line on stderr naming the flag and the fix, exit code 2."""
    try:
        # The user sees each adjustment as one note line on stdout, so stderr keeps only errors.
        with warnings.catch_warnings(record=True) as adjusted:
            warnings.simplefilter("always")
            config = config_from_argv(argv)
    except ConfigError as err:
        print(f"pretrain.py: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    # Once per run: the launcher (or torchrun's rank 0), not every worker it starts.
    if os.environ.get("RANK", "0") == "0" and "MEGATRON_LITE_ERROR_FILE" not in os.environ:
        for note in dict.fromkeys(str(w.message) for w in adjusted):
            print(f"pretrain.py: note: {note}", flush=True)
    return config
