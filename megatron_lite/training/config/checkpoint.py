"""The checkpoint section, Megatron-Bridge's CheckpointConfig."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.training.errors import ConfigError, require
from megatron_lite.utils import checkpoint_utils


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading, in Megatron's legacy ``torch`` format or megatron-core's ``torch_dist``."""

    save: str | None = None
    """Directory to save checkpoints into."""
    save_interval: int | None = None
    """Iterations between saves."""
    save_optim: bool = True
    """Save optimizer and scheduler state (not saving them is not supported yet: True)."""
    save_rng: bool = True
    """Save RNG state (not saving it is not supported yet: True)."""
    load: str | None = None
    """Directory to resume from; missing or empty starts fresh."""
    load_optim: bool = True
    """Load optimizer and scheduler state (--no-load-optim turns off)."""
    load_main_params_from_ckpt: bool = False
    """Without the optimizer's state (load_optim=False), start the fp32 main parameters from the
    checkpoint's weights rather than from the model's (which may hold them in lower precision)."""
    load_rng: bool = True
    """Load RNG state (--no-load-rng turns off)."""
    finetune: bool = False
    """Load weights only and reset the iteration count."""
    pretrained_checkpoint: str | None = None
    """Checkpoint to finetune from (weights only, iteration 0) when ``load`` holds none to resume."""
    ckpt_step: int | None = None
    """Load this iteration of ``load`` instead of its latest."""
    ckpt_format: str = "torch"
    """Format to save in: ``torch`` (legacy: one file per TP x PP rank, resumed at its layout) or
    ``torch_dist`` (DCP, loadable at any layout). A load detects the format of what it reads."""
    async_save: bool = False
    """``torch_dist`` only: copy the tensors to host memory and write them from a background process
    while training goes on; the checkpoint becomes the latest once every rank's write is done."""
    use_persistent_ckpt_worker: bool = True
    """Keep one background worker for async saves."""

    def finalize(self) -> None:
        if self.pretrained_checkpoint is not None:
            # Looked up through the module when called: upstream's tests patch it there.
            require(
                checkpoint_utils.file_exists(self.pretrained_checkpoint),
                "--pretrained-checkpoint",
                f"Pretrained checkpoint {self.pretrained_checkpoint} does not exist",
            )
        if self.load_main_params_from_ckpt:
            require(
                not self.load_optim,
                "--load-main-params-from-ckpt",
                "load_main_params_from_ckpt must be used with load_optim=False",
            )
        if self.async_save:
            require(
                self.save is not None,
                "--async-save",
                "async_save is enabled, but save is not set. Set save to a valid path.",
            )
        if self.ckpt_step is not None and self.load is None:
            raise ConfigError(
                "--ckpt-step",
                f"ckpt_step={self.ckpt_step} specified but checkpoint.load is None. "
                "Please set checkpoint.load to the base checkpoint directory (--load).",
            )
