"""Dataset sections of ConfigContainer, with Megatron-Bridge's names.

As upstream, the Bridge-facing ``seq_length`` is copied into core's ``sequence_length`` and the core
checks run in ``finalize()``, not at construction, so fields can still be changed after building the
config. Without ``blend`` the data is mock: megatron_lite's deterministic synthetic sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_lite.core.datasets.gpt_dataset import GPTDatasetConfig as _CoreGPTDatasetConfig
from megatron_lite.training.config_errors import ConfigError, UnexpectedFieldError, require


@dataclass(kw_only=True)
class DataloaderConfig:
    """How samples are batched into microbatches."""

    dataloader_type: str | None = "single"
    """single: each sample once, in order, resumable at any consumed-sample count (the only kind)."""

    def finalize(self) -> None:
        """Nothing to derive; the type is checked by ConfigContainer.validate."""


@dataclass(kw_only=True)
class GPTDatasetConfig(_CoreGPTDatasetConfig, DataloaderConfig):
    """Training data for a GPT: give ``seq_length`` (or core's ``sequence_length``)."""

    seq_length: int
    """Tokens per sample (must equal the model's seq_length); copied to sequence_length by finalize."""
    data_path: str | list[str] | None = None
    """Indexed dataset prefixes, Megatron-LM's --data-path (real data: not supported yet)."""

    def __init__(
        self,
        seq_length: int | None = None,
        *,
        data_path: str | list[str] | None = None,
        dataloader_type: str | None = "single",
        **kwargs,
    ):
        if seq_length is not None:
            kwargs["sequence_length"] = seq_length
        elif "sequence_length" not in kwargs:
            raise ConfigError("--seq-length", "Either `seq_length` or `sequence_length` must be provided.")
        kwargs.setdefault("random_seed", 1234)
        _CoreGPTDatasetConfig.__init__(self, **kwargs)
        self.data_path = data_path
        self.dataloader_type = dataloader_type
        self.seq_length = self.sequence_length

    def __post_init__(self) -> None:
        # Deferred to finalize(), as upstream: fields may still change after construction.
        pass

    def finalize(self) -> None:
        self.sequence_length = self.seq_length
        BlendedMegatronDatasetConfig.__post_init__(self)
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            require(getattr(self, name) is not None, f"dataset.{name}", f"{name} must be defined.")
        DataloaderConfig.finalize(self)


@dataclass(kw_only=True)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig that is always mock: ``blend`` and ``blend_per_split`` are refused."""

    def __init__(self, seq_length: int | None = None, **kwargs):
        super().__init__(seq_length=seq_length, **kwargs)

    def finalize(self) -> None:
        for name in ("blend", "blend_per_split"):
            if self.__dict__.get(name):
                raise UnexpectedFieldError(name, f"got an unexpected keyword argument '{name}'")
        # Reads fall through to the class defaults (None), so the config stays mock.
        self.__dict__.pop("blend", None)
        self.__dict__.pop("blend_per_split", None)
        super().finalize()
