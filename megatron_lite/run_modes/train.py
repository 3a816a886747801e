"""The training run mode: one worker's body for a validated ConfigContainer, shared by pretrain.py (a config
from flags) and scripts/training/run_recipe.py (a config from a recipe): the stop signals, the
Hugging Face directory reader, and each failure as one line and an exit code."""

from __future__ import annotations

import os
import signal
import traceback


def register_hf_directory_loader() -> None:
    """checkpoint.pretrained_checkpoint may name a Hugging Face directory, read through the bridge: imported
    (with transformers, seconds) only when a run names one."""
    from megatron_lite.training.checkpointing.hf_directory import register_hf_directory_loader

    def bridge_functions():
        from megatron_lite.bridge.models.conversion import pretrained_directory

        return pretrained_directory.hf_directory_model, pretrained_directory.load_hf_directory

    register_hf_directory_loader(bridge_functions)


def train_config(config, prog: str) -> int:
    """Train ``config`` on this rank; the exit code (2: bad input found late, 1: a failure)."""
    from megatron_lite.core.datasets.utils import DataFileError
    from megatron_lite.training.checkpointing import CheckpointError
    from megatron_lite.training.errors import ConfigError
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.launcher import report_error
    from megatron_lite.training.memory.postmortem import OutOfMemoryPostMortem
    from megatron_lite.training.pretrain import pretrain
    from megatron_lite.training.state import LoggerStartupError
    from megatron_lite.training.utils.sig_utils import exit_promptly_on
    from megatron_lite.utils.atomic_io import WriteFailedError

    register_hf_directory_loader()
    # With exit_signal_handler, SIGTERM asks the loop to save and exit 0 instead.
    stop = {signal.SIGINT} if config.train.exit_signal_handler else {signal.SIGINT, signal.SIGTERM}
    exit_promptly_on(stop)
    try:
        pretrain(config, forward_step)
    except (ConfigError, CheckpointError, LoggerStartupError, DataFileError) as err:
        report_error(f"{prog}: error: {err}")
        return 2
    except (OutOfMemoryPostMortem, WriteFailedError) as err:
        report_error(f"{prog}: error: {err}")
        return 1
    except KeyboardInterrupt:
        return 130
    except SystemExit as stop_exit:
        return stop_exit.code if isinstance(stop_exit.code, int) else 1
    except Exception:
        report_error(f"{prog}: rank {os.environ.get('RANK', '?')} failed:\n{traceback.format_exc().rstrip()}")
        return 1
    return 0
