"""The recipe runner behind ``scripts/training/run_recipe.py`` (Megatron-Bridge's script and flags).

    python scripts/training/run_recipe.py --recipe llama3_8b_pretrain_config -tp 2 train.train_iters=10

A recipe (``--recipe``), then ``--config-file FILE.yaml`` (nested overrides, or a whole config as
``ConfigContainer.to_yaml`` writes it), then Bridge's convenience flags (``-ms``, ``-gb``, ``-tp``, ...),
then trailing ``section.field=value`` overrides: later wins. ``model.seq_length`` follows
``dataset.seq_length``, as upstream's runner syncs it. The whole config is validated before any worker
starts or any file is written (bad input: ``run_recipe.py: error: ...``, exit 2); then the resolved
config is printed, saved as ``run_config.yaml`` beside the run's outputs (:func:`config_output_path`)
and trained as ``pretrain.py`` trains: on a machine of its own the runner forks its workers, which read
that file (``--config-file``); under torchrun it is one worker.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

from megatron_lite.recipes.overrides import apply_mapping, apply_overrides
from megatron_lite.recipes.registry import get_recipe
from megatron_lite.training.config import ConfigContainer, runtime_config_update
from megatron_lite.training.config.base import load_yaml_mapping
from megatron_lite.training.errors import ConfigError
from megatron_lite.utils.atomic_io import WriteFailedError

PROG = "run_recipe.py"

# (flag's dest, the field it sets): Bridge's COMMON_OVERRIDE_FIELDS, in its order.
COMMON_OVERRIDE_FIELDS = (
    ("max_steps", "train.train_iters"),
    ("global_batch_size", "train.global_batch_size"),
    ("micro_batch_size", "train.micro_batch_size"),
    ("seq_length", "dataset.seq_length"),
    ("tensor_model_parallel_size", "model.tensor_model_parallel_size"),
    ("pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
    ("context_parallel_size", "model.context_parallel_size"),
    ("virtual_pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size"),
    ("expert_model_parallel_size", "model.expert_model_parallel_size"),
    ("expert_tensor_parallel_size", "model.expert_tensor_parallel_size"),
    ("lr", "optimizer.lr"),
    ("min_lr", "optimizer.min_lr"),
    ("warmup_iters", "scheduler.lr_warmup_iters"),
    ("pretrained_checkpoint", "checkpoint.pretrained_checkpoint"),
    ("save_dir", "checkpoint.save"),
    ("load_dir", "checkpoint.load"),
    ("save_interval", "checkpoint.save_interval"),
)
# (short flag, long flag, type, metavar) of each convenience flag, as upstream's parser spells them.
_FLAGS = (
    ("-ms", "--max_steps", int, "STEPS"),
    ("-gb", "--global_batch_size", int, "SIZE"),
    ("-mb", "--micro_batch_size", int, "SIZE"),
    ("-sl", "--seq_length", int, "LENGTH"),
    ("-tp", "--tensor_model_parallel_size", int, "N"),
    ("-pp", "--pipeline_model_parallel_size", int, "N"),
    ("-cp", "--context_parallel_size", int, "N"),
    ("-vp", "--virtual_pipeline_model_parallel_size", int, "N"),
    ("-ep", "--expert_model_parallel_size", int, "N"),
    ("-etp", "--expert_tensor_parallel_size", int, "N"),
    (None, "--lr", float, "VALUE"),
    (None, "--min_lr", float, "VALUE"),
    (None, "--warmup_iters", int, "STEPS"),
    (None, "--pretrained_checkpoint", str, "PATH"),
    (None, "--save_dir", str, "PATH"),
    (None, "--load_dir", str, "PATH"),
    (None, "--save_interval", int, "STEPS"),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        # One line, like every other input error, instead of argparse's usage screen.
        print(f"{PROG}: error: {message} (see {PROG} --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The runner's flags; trailing ``key=value`` overrides are collected by :func:`parse_argv`."""
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        usage=f"{PROG} --recipe NAME [options] [section.field=value ...]",
        description="Train a recipe (Megatron-Bridge's names): the recipe, then --config-file, then the "
        "common flags, then trailing section.field=value overrides; later wins.",
        epilog="Overrides: section.field=value (nested a.b.c=value; values read as YAML and converted to the "
        "field's type), +dict.key=value adds a key, ~key removes one or sets an optional field to None. "
        "See docs/recipes.md.",
    )
    parser.add_argument("--recipe", help="Recipe function name, e.g. llama3_8b_pretrain_config.")
    parser.add_argument(
        "--config-file",
        "--config_file",
        dest="config_file",
        metavar="FILE",
        help="YAML applied on the recipe: nested overrides, or a whole config (ConfigContainer.to_yaml's).",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="Workers to start on this machine (default: the layout's model-parallel size x expert parallel).",
    )
    parser.add_argument(
        "--dry-run",
        "--dry_run",
        dest="dryrun",
        action="store_true",
        help="Resolve, validate and print the config; write nothing, train nothing.",
    )
    common = parser.add_argument_group("common overrides (a trailing key=value of the same field wins)")
    for (dest, field), (short, long, kind, metavar) in zip(COMMON_OVERRIDE_FIELDS, _FLAGS):
        names = [n for n in (short, long) if n]
        common.add_argument(*names, dest=dest, type=kind, metavar=metavar, help=f"Set {field}.")
    return parser


def parse_argv(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The flags and the ordered overrides: the convenience flags' first, then the trailing ones."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    for item in rest:
        if item.startswith("-"):
            parser.error(f"unrecognized argument {item!r}")
        if "=" not in item and not item.startswith("~"):
            parser.error(f"expected a key=value override, got {item!r}")
    common = []
    for dest, field in COMMON_OVERRIDE_FIELDS:
        value = getattr(args, dest)
        if value is not None:
            common.append(f"{field}={json.dumps(value) if isinstance(value, str) else value}")
    return args, [*common, *rest]


def _sync_seq_length(config: ConfigContainer) -> None:
    # As upstream's runner: the dataset owns the sequence length, the model follows it.
    seq = getattr(config.dataset, "seq_length", None)
    if seq is not None and config.model is not None and config.model.seq_length != seq:
        config.model.seq_length = seq


def resolve_config(argv: list[str]) -> tuple[ConfigContainer, argparse.Namespace]:
    """The config ``argv`` describes, not yet validated (ConfigError for bad input)."""
    args, overrides = parse_argv(argv)
    loaded = load_yaml_mapping(args.config_file) if args.config_file else None
    if loaded is not None and "_target_" in loaded:  # a whole config: the base instead of a recipe
        config = ConfigContainer.from_dict(loaded, strict=True)
    elif args.recipe is None:
        raise ConfigError("--recipe", "is required (or a --config-file holding a whole config)")
    else:
        config = get_recipe(args.recipe)
        if loaded is not None:
            apply_mapping(config, loaded)
    apply_overrides(config, overrides)
    _sync_seq_length(config)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if args.nproc_per_node is not None:
        config.dist.nproc_per_node = args.nproc_per_node
    elif config.dist.nproc_per_node is None and not under_torchrun:
        ep = getattr(config.model, "expert_model_parallel_size", 1) or 1
        config.dist.nproc_per_node = config.model_parallel_size * ep
    return config, args


def validated_config(argv: list[str]) -> tuple[ConfigContainer, argparse.Namespace, list[str]]:
    """:func:`resolve_config`, then upstream's runtime update and every check (ConfigError); the
    adjustments the checks made, as note lines."""
    with warnings.catch_warnings(record=True) as adjusted:
        warnings.simplefilter("always")
        config, args = resolve_config(argv)
        runtime_config_update(config)
    return config, args, list(dict.fromkeys(str(w.message) for w in adjusted))


def config_output_path(config: ConfigContainer) -> str:
    """Where the resolved config is saved: ``run_config.yaml`` in the directory that holds the
    checkpoints (``checkpoint.save``'s parent), else the TensorBoard directory's parent, else a fresh
    ``runs/<time>/``."""
    for directory in (config.checkpoint.save, config.logger.tensorboard_dir):
        if directory:
            return os.path.join(os.path.dirname(os.path.abspath(directory)), "run_config.yaml")
    return os.path.abspath(os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"), "run_config.yaml"))


def _fail(err: ConfigError) -> int:
    """One line naming the config key: the checks name pretrain.py's flag, which this script lacks."""
    from megatron_lite.training.cli.flags import FLAGS

    keys = {flag: f"{section}.{name}" for flag, section, name, _kind, _help in FLAGS if name}
    text = str(err)
    if err.flag in keys and text.startswith(f"{err.flag}: "):
        text = f"{keys[err.flag]}: {text[len(err.flag) + 2 :]}"
    print(f"{PROG}: error: {text}", file=sys.stderr)
    return 2


def main(argv: list[str], script: str) -> int:
    """Resolve, validate, print, save and train (``script`` is what the launcher's workers run). Under
    torchrun every rank resolves the same config and trains it; rank 0 prints and saves it."""
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        config, args, notes = validated_config(argv)
    except ConfigError as err:
        return _fail(err)
    rank0 = os.environ.get("RANK", "0") == "0"
    if rank0:
        for note in notes:
            print(f"{PROG}: note: {note}", flush=True)
        print(config.yaml_text(), flush=True)
    if args.dryrun:
        return 0
    path = config_output_path(config)
    if rank0:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            config.to_yaml(path)
        except (OSError, WriteFailedError) as err:  # an unwritable output directory: one line, no worker
            return _fail(ConfigError("run_config.yaml", f"cannot write {path}: {err}"))
        print(f" resolved config: {path}", flush=True)
    if under_torchrun:
        from megatron_lite.run_modes.train import train_config

        return train_config(config, PROG)

    from megatron_lite.training.launcher import launch

    command = [sys.executable, os.path.abspath(script), "--config-file", path]
    return launch(command, config.world_size, entry=worker_main)


def worker_main(argv: list[str]) -> int:
    """One worker the launcher forked: the config ``argv`` gives (``--config-file`` of the saved YAML,
    already validated in the launcher), trained as pretrain.py's workers train."""
    from megatron_lite.run_modes.train import train_config

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the launcher printed the notes once
            config, _args, _notes = validated_config(argv)
    except ConfigError as err:
        return _fail(err)
    return train_config(config, PROG)
