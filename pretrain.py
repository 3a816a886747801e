#!/usr/bin/env python
"""Pretrain a GPT with megatron_lite.

    python pretrain.py --pipeline-model-parallel-size 4 --log-memory-to-tensorboard
    torchrun --nproc-per-node 8 pretrain.py --tensor-model-parallel-size 2 ...

Without torchrun's environment this script starts its own workers on this machine (world size
--nproc-per-node, default tp x pp x cp). Under torchrun it is one worker of torchrun's world.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback


def _report(message: str) -> None:
    from megatron_lite.training.launcher import report_error

    report_error(message)


def _register_hf_directory_loader() -> None:
    """``--pretrained-checkpoint`` may name a Hugging Face directory, read through the bridge: imported
    (with transformers, seconds) only when a run names one."""
    from megatron_lite.training.checkpointing.hf_directory import register_hf_directory_loader

    def bridge_functions():
        from megatron_lite.bridge.models.conversion import pretrained_directory

        return pretrained_directory.hf_directory_model, pretrained_directory.load_hf_directory

    register_hf_directory_loader(bridge_functions)


def worker_main(argv: list[str]) -> int:
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.utils.sig_utils import exit_promptly_on

    _register_hf_directory_loader()
    config = parse_args(argv)
    # With --exit-signal-handler, SIGTERM asks the loop to save and exit 0 instead.
    stop = {signal.SIGINT} if config.train.exit_signal_handler else {signal.SIGINT, signal.SIGTERM}
    # Each gets a handler that unwinds (KeyboardInterrupt, SystemExit(128 + n)) whatever this process
    # inherited (SIGINT ignored in a shell's background job), and ends it also while blocked in C++.
    exit_promptly_on(stop)

    from megatron_lite.core.datasets.utils import DataFileError
    from megatron_lite.training.checkpointing import CheckpointError
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.memory.postmortem import OutOfMemoryPostMortem
    from megatron_lite.training.pretrain import pretrain
    from megatron_lite.training.state import LoggerStartupError
    from megatron_lite.utils.atomic_io import WriteFailedError

    try:
        pretrain(config, forward_step)
    except (CheckpointError, LoggerStartupError, DataFileError) as err:
        _report(f"pretrain.py: error: {err}")
        return 2
    except (OutOfMemoryPostMortem, WriteFailedError) as err:  # a full disk: one line, not a traceback
        _report(f"pretrain.py: error: {err}")
        return 1
    except KeyboardInterrupt:
        return 130
    except SystemExit as stop:  # SIGTERM without --exit-signal-handler (see sig_utils.raise_exit)
        return stop.code if isinstance(stop.code, int) else 1
    except Exception:
        rank = os.environ.get("RANK", "?")
        _report(f"pretrain.py: rank {rank} failed:\n{traceback.format_exc().rstrip()}")
        return 1
    return 0


def main(argv: list[str]) -> int:
    _register_hf_directory_loader()
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
