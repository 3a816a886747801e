#!/usr/bin/env python
"""Hugging Face models to megatron_lite checkpoints and back (Megatron-Bridge's
examples/conversion/convert_checkpoints.py), on this machine's CPUs.

    python tools/checkpoint_conversion.py import --hf-model DIR --megatron-path CKPT \\
        [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]
    python tools/checkpoint_conversion.py export --hf-model DIR --megatron-path CKPT --hf-path OUT \\
        [--adapter-only] [--base-checkpoint BASE]

``import`` starts T x P workers; each reads only its own shard of the weights from DIR's safetensors
and writes it as iteration 0 of CKPT (Megatron's layout, the architecture recorded): train from it with
``pretrain.py --pretrained-checkpoint CKPT --use-checkpoint-args`` at any layout. ``export`` starts one
worker per shard of CKPT's latest iteration and writes OUT (config.json from DIR, sharded safetensors,
DIR's tokenizer files), loadable by ``transformers``. A LoRA run's checkpoint (adapters only) exports
with its base (the checkpoint it names, or ``--base-checkpoint``): the merged model by default, or with
``--adapter-only`` a Hugging Face PEFT adapter directory (adapter_config.json + adapter_model.safetensors)
that ``peft`` loads onto the base. Nothing is downloaded; no code from DIR runs.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PROG = "checkpoint_conversion.py"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", help="Hugging Face directory -> megatron_lite checkpoint")
    exp = sub.add_parser("export", help="megatron_lite checkpoint -> Hugging Face directory")
    for p in (imp, exp):
        p.add_argument("--hf-model", required=True, help="Local Hugging Face model directory.")
        p.add_argument("--megatron-path", required=True, help="megatron_lite checkpoint directory.")
        p.add_argument("--quiet", action="store_true", help="No line per tensor.")
    imp.add_argument("--tensor-model-parallel-size", type=int, default=1)
    imp.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    exp.add_argument("--hf-path", required=True, help="Directory to write (replaced once complete).")
    exp.add_argument(
        "--adapter-only",
        action="store_true",
        help="A LoRA checkpoint's adapters alone, as a Hugging Face PEFT adapter directory "
        "(adapter_config.json + adapter_model.safetensors), instead of the merged model.",
    )
    exp.add_argument(
        "--base-checkpoint",
        help="A LoRA checkpoint's base model (megatron_lite checkpoint or Hugging Face directory), "
        "instead of the one the checkpoint names.",
    )
    return parser


def _check(args, bridge) -> int:
    """The world size; one-line BridgeError for a layout the model cannot take."""
    from megatron_lite.bridge import BridgeError
    from megatron_lite.bridge.models.conversion.megatron_checkpoints import export_provider, saved_layout
    from megatron_lite.bridge.models.conversion.peft_checkpoints import base_of, peft_checkpoint
    from megatron_lite.training.checkpointing import read_tracker
    from megatron_lite.training.checkpointing.reshard import read_saved_config

    if args.command == "export":
        iteration, layout = saved_layout(args.megatron_path)
        target = os.path.realpath(args.hf_path)
        for flag in ("--hf-model", "--megatron-path"):
            source = os.path.realpath(getattr(args, flag[2:].replace("-", "_")))
            if os.path.commonpath([target, source]) in (target, source):
                raise BridgeError(
                    f"--hf-path {args.hf_path} would replace or lie inside {flag}; write elsewhere"
                )
        export_provider(bridge, args.megatron_path, read_saved_config(args.megatron_path, iteration))
        peft = peft_checkpoint(args.megatron_path)
        if peft is None and (args.adapter_only or args.base_checkpoint):
            flag = "--adapter-only" if args.adapter_only else "--base-checkpoint"
            raise BridgeError(
                f"{flag}: --megatron-path {args.megatron_path} is a full model checkpoint, not LoRA adapters"
            )
        if peft is not None:
            base = os.path.realpath(base_of(args.megatron_path, peft[0], args.base_checkpoint))
            if os.path.commonpath([target, base]) in (target, base):
                raise BridgeError(f"--hf-path {args.hf_path} would replace or lie inside the base {base}")
        args.tensor_model_parallel_size = layout.get("tensor_model_parallel_size", 1)
        args.pipeline_model_parallel_size = layout.get("pipeline_model_parallel_size", 1)
        return args.tensor_model_parallel_size * args.pipeline_model_parallel_size
    if read_tracker(args.megatron_path, flag="--megatron-path") is not None:
        raise BridgeError(
            f"--megatron-path {args.megatron_path} already holds a checkpoint; import into a new directory"
        )
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    provider = bridge.to_megatron_provider(load_weights=False)
    if tp < 1 or pp < 1:
        raise BridgeError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    for what, value in (
        ("num_attention_heads", provider.num_attention_heads),
        ("num_query_groups", provider.num_query_groups),
        ("ffn_hidden_size", provider.ffn_hidden_size),
        # Each expert and the shared expert split like the dense MLP (expert TP is TP here).
        ("moe_ffn_hidden_size", provider.moe_ffn_hidden_size or 0),
        ("moe_shared_expert_intermediate_size", provider.moe_shared_expert_intermediate_size or 0),
    ):
        if value % tp:
            raise BridgeError(
                f"--tensor-model-parallel-size {tp} does not divide the model's {what} ({value})"
            )
    if provider.num_layers % pp:
        raise BridgeError(
            f"--pipeline-model-parallel-size {pp} does not divide the model's {provider.num_layers} layers"
        )
    if os.path.abspath(args.megatron_path) == os.path.abspath(args.hf_model):
        raise BridgeError("--megatron-path must not be the --hf-model directory")
    return tp * pp


def worker_main(argv: list[str]) -> int:
    import torch.distributed as dist

    from megatron_lite.bridge import AutoBridge, BridgeError
    from megatron_lite.bridge.models.conversion.megatron_checkpoints import export_ckpt, import_ckpt
    from megatron_lite.bridge.models.conversion.peft_checkpoints import export_peft_ckpt, peft_checkpoint
    from megatron_lite.core import parallel_state
    from megatron_lite.training.checkpointing import CheckpointError
    from megatron_lite.training.launcher import worker_exit_code

    args = _parser().parse_args(argv)

    def body() -> None:
        bridge = AutoBridge.from_hf_pretrained(args.hf_model)
        _check(args, bridge)
        dist.init_process_group("gloo")
        parallel_state.initialize_model_parallel(
            args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        )
        if args.command == "import":
            import_ckpt(bridge, args.megatron_path, show_progress=not args.quiet)
        elif peft_checkpoint(args.megatron_path) is not None:  # LoRA adapters only, and their base
            export_peft_ckpt(
                bridge, args.megatron_path, args.hf_path, adapter_only=args.adapter_only,
                base_checkpoint=args.base_checkpoint, show_progress=not args.quiet,
            )  # fmt: skip
        else:
            export_ckpt(bridge, args.megatron_path, args.hf_path, show_progress=not args.quiet)

    try:
        code = worker_exit_code(PROG, body, (BridgeError, CheckpointError))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if code:
        return code
    if os.environ.get("RANK", "0") == "0":
        where = args.megatron_path if args.command == "import" else args.hf_path
        print(f" {args.command}: wrote {where}", flush=True)
    return 0


def main(argv: list[str]) -> int:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker_main(argv)
    from megatron_lite.bridge import AutoBridge, BridgeError
    from megatron_lite.training.checkpointing import CheckpointError
    from megatron_lite.training.launcher import launch

    args = _parser().parse_args(argv)
    try:  # before any worker starts or any file is written
        world = _check(args, AutoBridge.from_hf_pretrained(args.hf_model))
    except (BridgeError, CheckpointError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    return launch([sys.executable, os.path.abspath(__file__), *argv], world, entry=worker_main)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
