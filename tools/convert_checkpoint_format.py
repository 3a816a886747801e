#!/usr/bin/env python
"""Convert a checkpoint between the legacy ``torch`` format and ``torch_dist`` (either way), on this
machine's CPUs: model, optimizer, learning-rate schedule, train state and RNG state.

    python tools/convert_checkpoint_format.py --load IN --save OUT --ckpt-format torch_dist
    python tools/convert_checkpoint_format.py --load IN --save OUT --ckpt-format torch [--ckpt-step N]

``--ckpt-format`` names the target format; IN's is detected from its ``metadata.json``. OUT must be new
or empty, and gets IN's iteration (its latest, or ``--ckpt-step``'s) under the same iteration number,
named by OUT's ``latest_checkpointed_iteration.txt``; IN is only read. Resuming from OUT trains on as
resuming from IN would (a ``torch_dist`` OUT at any layout, a ``torch`` one at IN's).

How: Megatron-LM's own route, its ``--ckpt-convert-format`` / ``--ckpt-convert-save`` flags of
pretrain (accepted here too: ``--ckpt-convert-save DIR`` writes ``DIR/<format>`` as upstream), which
load a checkpoint with the whole training setup and save it again in the other format, then exit.
The run is rebuilt from the config the checkpoint records (``config`` of its first shard, or of
``common.pt``): pretrain's flag parser gives a fresh config, the saved model, optimizer, DDP,
schedule, training, validation and RNG sections replace its own, and the usual validation runs. No
data is read and nothing is logged, so the saved data, tokenizer and logger settings are not needed
(OUT's recorded config has this conversion's defaults there). Then, as pretrain's setup does, on one
worker per rank of IN's layout (tp x pp x cp x dp, from that config): model-parallel groups, the model
and its optimizer and scheduler, ``load_checkpoint`` (which reads either format and checks every shard
against the model), and ``save_checkpoint`` with ``--ckpt-format`` (written atomically). Bad input
(a missing or empty IN, IN already in the target format, OUT inside IN or not empty, a config that
does not validate) is one line on stderr and exit code 2 before any worker starts or any file is written.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from dataclasses import fields

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "convert_checkpoint_format.py"
FORMATS = ("torch", "torch_dist")
# The saved config's sections that decide what is built and how the state loads; the others are
# this run's (paths, data, tokenizer, loggers, launcher).
SECTIONS = ("model", "optimizer", "ddp", "scheduler", "train", "validation", "rng", "rerun_state_machine")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, metavar="IN", help="Checkpoint directory to convert.")
    out = parser.add_mutually_exclusive_group(required=True)
    out.add_argument("--save", metavar="OUT", help="New (or empty) directory for the converted checkpoint.")
    out.add_argument("--ckpt-convert-save", metavar="DIR", help="Upstream's form: write DIR/<format>.")
    parser.add_argument(
        "--ckpt-format", "--ckpt-convert-format", required=True, choices=FORMATS, help="Target format."
    )
    parser.add_argument(
        "--ckpt-step", type=int, metavar="N", help="Convert iteration N (default: the latest)."
    )
    return parser


def _arguments(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.ckpt_convert_save is not None:
        args.save = os.path.join(args.ckpt_convert_save, args.ckpt_format)
    return args


def _source(args) -> tuple[int, dict]:
    """IN's iteration to convert and its saved config; CheckpointError for any bad input. Runs in the
    launcher and in every worker before its first collective, so before any rank writes."""
    from megatron_lite.training.checkpointing import CheckpointError, read_tracker
    from megatron_lite.training.checkpointing.layout import is_distributed_checkpoint
    from megatron_lite.training.checkpointing.reshard import read_saved_config

    src, dst = os.path.realpath(args.load), os.path.realpath(args.save)
    if not os.path.isdir(args.load):
        raise CheckpointError(f"--load {args.load}: no such directory")
    if os.path.commonpath([src, dst]) in (src, dst):
        raise CheckpointError(
            f"--save {args.save} would lie inside --load {args.load} or hold it; write elsewhere"
        )
    if os.path.exists(args.save) and (not os.path.isdir(args.save) or os.listdir(args.save)):
        raise CheckpointError(f"--save {args.save}: exists and is not an empty directory; write elsewhere")
    iteration = read_tracker(args.load) if args.ckpt_step is None else args.ckpt_step
    if iteration is None:
        raise CheckpointError(f"--load {args.load}: holds no checkpoint to convert")
    if not os.path.isdir(os.path.join(args.load, f"iter_{iteration:07d}")):
        named = "--ckpt-step names it" if args.ckpt_step is not None else "its tracker names it"
        raise CheckpointError(f"--load {args.load}: has no iter_{iteration:07d} ({named})")
    fmt = "torch_dist" if is_distributed_checkpoint(args.load, iteration) else "torch"
    if fmt == args.ckpt_format:
        raise CheckpointError(
            f"--load {args.load}: iteration {iteration} is in {fmt} format already; nothing to convert"
        )
    return iteration, read_saved_config(args.load, iteration)


def _config(args, iteration: int, saved: dict):
    """The saving run's config for loading IN and saving OUT, validated (ConfigError otherwise)."""
    import enum

    from megatron_lite.training.arguments import build_parser, config_from_args
    from megatron_lite.training.checkpointing.checkpoint_args import saved_activation
    from megatron_lite.training.errors import ConfigError

    flags = ["--load", args.load, "--save", args.save, "--ckpt-format", args.ckpt_format]
    with warnings.catch_warnings():  # notes the saving run printed already
        warnings.simplefilter("ignore")
        config = config_from_args(build_parser().parse_args([*flags, "--ckpt-step", str(iteration)]))
        for section in SECTIONS:
            target, values = getattr(config, section), saved.get(section) or {}
            for f in fields(target):
                if not f.init or f.name.startswith("_") or f.name not in values:
                    continue  # derived again by validate(), or a field the saving version lacked
                value, current = values[f.name], getattr(target, f.name)
                if f.name == "activation_func":  # recorded by name
                    value = saved_activation(args.load, value, "--load")
                elif callable(current):
                    continue  # recorded by name only (the init methods): this run's derive the same
                elif isinstance(current, enum.Enum):
                    value = type(current)[value]
                setattr(target, f.name, value)
        if config.train.train_samples is not None:
            config.train.train_iters = None  # validate() derives it from the samples again
        config.dataset.seq_length = config.model.seq_length
        config.dataset.random_seed = config.rng.seed
        dp = saved.get("_data_parallel_size") or 1
        config.dist.nproc_per_node = config.model_parallel_size * dp
        try:
            config.validate()
        except ConfigError as err:
            raise ConfigError("--load", f"{args.load}'s saved config does not validate ({err})") from None
    return config


def worker_main(argv: list[str]) -> int:
    import torch.distributed as dist

    from megatron_lite.core import parallel_state
    from megatron_lite.training import checkpointing
    from megatron_lite.training.errors import ConfigError
    from megatron_lite.training.initialize import initialize_megatron
    from megatron_lite.training.launcher import worker_exit_code
    from megatron_lite.training.setup import build_model_and_optimizer, get_optimizer_param_scheduler
    from megatron_lite.training.state import GlobalState

    args = _arguments(argv)

    def body() -> None:
        iteration, saved = _source(args)
        config = _config(args, iteration, saved)
        if int(os.environ["WORLD_SIZE"]) != config.world_size:  # under torchrun: its world must fit
            raise ConfigError(
                "WORLD_SIZE", f"{args.load} was saved by {config.world_size} ranks; start as many workers"
            )
        state = GlobalState(config)
        pg_collection = initialize_megatron(config)
        model, optimizer = build_model_and_optimizer(config, pg_collection)
        scheduler = get_optimizer_param_scheduler(config, optimizer)
        checkpointing.load_checkpoint(state, model, optimizer, scheduler, pg_collection)
        if state.train_state.step != iteration:
            raise checkpointing.CheckpointError(
                f"--load {args.load}: iter_{iteration:07d} holds the train state of iteration "
                f"{state.train_state.step}; it cannot keep its iteration number"
            )
        checkpointing.save_checkpoint(state, model, optimizer, scheduler, pg_collection)
        dist.barrier()

    try:
        return worker_exit_code(PROG, body, (checkpointing.CheckpointError, ConfigError))
    finally:
        checkpointing.close_async_writer()
        if dist.is_initialized():
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker_main(argv)
    from megatron_lite.training.checkpointing import CheckpointError
    from megatron_lite.training.errors import ConfigError
    from megatron_lite.training.launcher import launch

    args = _arguments(argv)
    try:  # before any worker starts or any file is written
        iteration, saved = _source(args)
        config = _config(args, iteration, saved)
    except (CheckpointError, ConfigError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    code = launch([sys.executable, os.path.abspath(__file__), *argv], config.world_size, entry=worker_main)
    if code == 0:
        source = "torch" if args.ckpt_format == "torch_dist" else "torch_dist"
        print(
            f" converted checkpoint: {args.load} ({source}) -> {args.save} ({args.ckpt_format}), "
            f"iteration {iteration}",
            flush=True,
        )
    return code


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "RANK" in os.environ:  # a worker: skip interpreter teardown, as pretrain.py's workers do
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
