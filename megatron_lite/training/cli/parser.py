"""Megatron-LM command-line flags, parsed onto a validated ConfigContainer (upstream: training.arguments).

Each flag maps to one config field; its help text is the field's docstring (cli/field_docs.py). Flags of upstream
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

from megatron_lite.core.activations import openai_gelu, squared_relu
from megatron_lite.training.checkpointing.checkpoint_args import model_from_checkpoint
from megatron_lite.training.cli.data_args import dataset_from_args, prepare_dataset_section
from megatron_lite.training.cli.field_docs import field_docs
from megatron_lite.training.cli.flags import FLAGS, PROFILING_FLAGS, UNSUPPORTED_FLAGS
from megatron_lite.training.cli.moe_args import moe_from_args
from megatron_lite.training.cli.parallel_args import virtual_pipeline_from_args
from megatron_lite.training.cli.peft_args import peft_from_args, peft_section
from megatron_lite.training.cli.ranges import check_parsed_flags
from megatron_lite.training.cli.sft_args import sft_section
from megatron_lite.training.config import ConfigContainer, ConfigError
from megatron_lite.training.config.profiling import ProfilingConfig


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
    defaults.peft = peft_section()()  # the section --peft builds: its defaults are the --lora-* ones
    sft_defaults = sft_section()()  # the section --sft builds: its defaults are the --sft-* ones
    groups: dict[str, argparse._ArgumentGroup] = {}
    metavars = {int: "N", float: "X", str: "S"}
    for flag, section, name, kind, help_text in FLAGS:
        group = groups.setdefault(section, parser.add_argument_group(f"{section} (config.{section})"))
        owner = getattr(defaults, section)
        if section == "dataset" and not hasattr(owner, name or "seq_length"):
            owner = sft_defaults  # a field of the section --sft builds
        if help_text is None:  # written once, on the field (which a store_false flag turns off)
            help_text = field_docs(type(owner))[name]
            help_text = f"Turns off: {help_text}" if kind == "store_false" else help_text
        dest = flag[2:].replace("-", "_")
        if kind in ("store_true", "store_false"):
            group.add_argument(flag, dest=dest, action=kind, default=None, help=help_text)
        elif kind == "+":
            group.add_argument(flag, dest=dest, nargs="+", default=None, metavar="S", help=help_text)
        elif isinstance(kind, list):  # [type]: one or more values of that type
            group.add_argument(
                flag,
                dest=dest,
                nargs="+",
                type=kind[0],
                default=None,
                metavar=metavars[kind[0]],
                help=help_text,
            )
        else:
            default = getattr(owner, name) if name else None
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
    preflight = parser.add_argument_group(
        "memory preflight (predict, or dry-run on fake tensors; write nothing, train nothing)"
    )
    preflight.add_argument(
        "--memory-preflight",
        action="store_true",
        help="Print each stage's predicted memory, the stage that runs out first and the cheapest fix; exit.",
    )
    preflight.add_argument(
        "--device-memory-gb", type=float, metavar="GB", help="The GPU's memory (preflight)."
    )
    preflight.add_argument(
        "--memory-preflight-json",
        metavar="FILE",
        help="Also write the preflight's per-stage bytes, verdict and recommendation to FILE (JSON).",
    )
    preflight.add_argument(
        "--memory-preflight-html",
        metavar="FILE",
        help="Also draw the preflight on a self-contained HTML page: each stage's stacked parts, the dry run's "
        "peak beside them, the device line.",
    )
    preflight.add_argument(
        "--memory-dry-run",
        action="store_true",
        help="Preflight: also run each stage's real code once at full size on fake tensors and show its "
        "measured allocated peak beside the prediction.",
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
    """Map parsed flags onto a ConfigContainer (not yet validated); every numeric value is in its
    flag's range first."""
    check_parsed_flags(args)
    for flag in UNSUPPORTED_FLAGS:
        value = getattr(args, "unsupported_" + flag[2:].replace("-", "_"))
        if value not in (None, False):
            raise ConfigError(flag, "is not supported yet by megatron_lite")
    config = ConfigContainer()
    prepare_dataset_section(args, config)
    peft_from_args(args, config)  # the section the --lora-* rows fill in
    for flag, section, name, _kind, _help in FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and name is not None:
            setattr(getattr(config, section), name, value)
    dataset_from_args(args, config)
    config.profiling = _profiling_from_args(args)
    if args.memory_dry_run:
        raise ConfigError("--memory-dry-run", "is part of the preflight: give it with --memory-preflight")
    if (
        args.memory_preflight
        or args.device_memory_gb is not None
        or args.memory_preflight_json is not None
        or args.memory_preflight_html is not None
    ):
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
    if args.use_checkpoint_args:  # the saved architecture replaces the flags' and what they derived
        model_from_checkpoint(args, config)
    moe_from_args(args, m)
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
    """The flags that set more than one model field or need another: activations, the rope scaling
    factor, grouped-query attention, --recompute-activations (upstream's alias of
    --recompute-granularity selective) and the virtual pipeline size's aliases."""
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
    if args.openai_gelu:
        if args.swiglu or args.squared_relu:
            raise ConfigError(
                "--openai-gelu", "cannot be combined with --swiglu or --squared-relu; choose one activation"
            )
        m.activation_func = openai_gelu
    if args.rope_scaling_factor is not None and not args.use_rope_scaling:
        raise ConfigError("--rope-scaling-factor", "needs --use-rope-scaling (upstream ignores it without)")
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
