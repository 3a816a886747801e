#!/usr/bin/env python
"""Pretrain a GPT with megatron_lite.

    python pretrain.py --pipeline-model-parallel-size 4 --log-memory-to-tensorboard
    torchrun --nproc-per-node 8 pretrain.py --tensor-model-parallel-size 2 ...

Without torchrun's environment this script starts its own workers on this machine (world size
--nproc-per-node, default tp x pp x cp). Under torchrun it is one worker of torchrun's world.
"""

from __future__ import annotations

import os
import sys


def worker_main(argv: list[str]) -> int:
    from megatron_lite.run_modes.train import register_hf_directory_loader, train_config
    from megatron_lite.training.arguments import parse_args

    register_hf_directory_loader()  # before the flags are read: they may name a Hugging Face directory
    return train_config(parse_args(argv), "pretrain.py")


def main(argv: list[str]) -> int:
    from megatron_lite.run_modes.train import register_hf_directory_loader

    register_hf_directory_loader()
    if "--memory-preflight" in argv:  # a prediction (and dry run): no worker, no file but its JSON
        from megatron_lite.run_modes.preflight import main as preflight

        return preflight(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return worker_main(argv)

    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.launcher import launch

    # Validate here, before any worker starts or any file is written.
    config = parse_args(argv)
    if "--tensorboard-dir" not in argv and config.logger.tensorboard_dir:
        argv = [*argv, "--tensorboard-dir", config.logger.tensorboard_dir]  # one default for all workers
    code = launch([sys.executable, os.path.abspath(__file__), *argv], config.world_size, entry=worker_main)
    if code == 0 and config.logger.tensorboard_dir:
        print(
            f" logs: {config.logger.tensorboard_dir}  (tensorboard --logdir {config.logger.tensorboard_dir}; "
            f"python tools/memory_report.py {config.logger.tensorboard_dir})"
        )
    if code == 0 and config.profiling is not None and config.profiling.use_pytorch_profiler:
        traces = os.path.join(os.path.dirname(config.logger.tensorboard_dir), "torch_profile")
        print(f" profiler traces: {traces}  (one rank-<rank>.json.gz per profiled rank; open in Perfetto)")
    return code


def exit_worker(code: int):
    """Leave a worker process with ``code``, skipping interpreter teardown: a worker's process groups
    (gloo's threads) can abort in their C++ teardown at interpreter exit, even after a clean destroy,
    and a stop signal arriving during teardown would print tracebacks. Loggers, checkpoints and output
    are closed and flushed by now."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if "RANK" in os.environ:
        exit_worker(code)
    sys.exit(code)
