"""The checkpoint section, Megatron-Bridge's CheckpointConfig (legacy torch format)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.training.config.errors import ConfigError, require


@dataclass(kw_only=True)
class CheckpointConfig:
    """Saving and loading, in Megatron's legacy torch format (``ckpt_format="torch"``)."""

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
    """Load fp32 main parameters from the checkpoint (not supported yet: False)."""
    load_rng: bool = True
    """Load RNG state (--no-load-rng turns off)."""
    finetune: bool = False
    """Load weights only and reset the iteration count."""
    pretrained_checkpoint: str | None = None
    """Separate checkpoint to finetune from (not supported yet: use load with finetune)."""
    ckpt_step: int | None = None
    """Load this iteration instead of the latest (not supported yet: None)."""
    ckpt_format: str = "torch"
    """Checkpoint format: megatron_lite reads and writes Megatron's legacy ``torch`` format."""
    async_save: bool = False
    """Save in the background (not supported yet: False)."""
    use_persistent_ckpt_worker: bool = True
    """Keep one background worker for async saves."""

    def finalize(self) -> None:
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
                "--ckpt-step", f"ckpt_step={self.ckpt_step} specified but checkpoint.load is None; set --load"
            )
