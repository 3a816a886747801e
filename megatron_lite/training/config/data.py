"""Dataset sections of ConfigContainer, with Megatron-Bridge's names.

As upstream, the Bridge-facing ``seq_length`` is copied into core's ``sequence_length`` and the core
checks run in ``finalize()``, not at construction, so fields can still be changed after building the
config; ``data_path`` (Megatron-LM's ``--data-path`` list) becomes ``blend`` there. Without ``blend``
or ``blend_per_split`` the data is mock: megatron_lite's deterministic synthetic sequences.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_lite.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron_lite.core.datasets.gpt_dataset import GPTDatasetConfig as _CoreGPTDatasetConfig
from megatron_lite.data.base import DataloaderConfig
from megatron_lite.data.sft.config import SFTDatasetConfig  # noqa: F401  (--sft's section, re-exported)
from megatron_lite.training.errors import ConfigError, UnexpectedFieldError, require


@dataclass(kw_only=True)
class GPTDatasetConfig(_CoreGPTDatasetConfig, DataloaderConfig):
    """Training data for a GPT: give ``seq_length`` (or core's ``sequence_length``)."""

    seq_length: int
    """Tokens per sample (must equal the model's seq_length); copied to sequence_length by finalize."""
    data_path: str | list[str] | None = None
    """Megatron-LM's --data-path: prefixes, optionally weighted ("0.3 A 0.7 B"); finalize makes it
    ``blend``."""

    def __init__(
        self,
        seq_length: int | None = None,
        *,
        data_path: str | list[str] | None = None,
        dataloader_type: str | None = "single",
        num_workers: int = 2,
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
        self.num_workers = num_workers
        self.seq_length = self.sequence_length

    def __post_init__(self) -> None:
        # Deferred to finalize(), as upstream: fields may still change after construction.
        pass

    def finalize(self) -> None:
        self.sequence_length = self.seq_length
        if self.blend is None and self.data_path is not None:
            paths = self.data_path.split() if isinstance(self.data_path, str) else list(self.data_path)
            self.blend = parse_blend("--data-path", paths)
        if self.split is not None and self.blend_per_split is None:
            check_split(self.split)
        BlendedMegatronDatasetConfig.__post_init__(self)
        for name in ("reset_position_ids", "reset_attention_mask", "eod_mask_loss"):
            require(getattr(self, name) is not None, f"dataset.{name}", f"{name} must be defined.")
        DataloaderConfig.finalize(self)


@dataclass(kw_only=True)
class MockGPTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig that is always mock: ``blend`` and ``blend_per_split`` are refused.
    Its samples are computed in the training process (``num_workers`` 0: no worker would be faster)."""

    def __init__(self, seq_length: int | None = None, num_workers: int = 0, **kwargs):
        super().__init__(seq_length=seq_length, num_workers=num_workers, **kwargs)

    def finalize(self) -> None:
        for name in ("blend", "blend_per_split"):
            if self.__dict__.get(name):
                raise UnexpectedFieldError(name, f"got an unexpected keyword argument '{name}'")
        # Reads fall through to the class defaults (None), so the config stays mock.
        self.__dict__.pop("blend", None)
        self.__dict__.pop("blend_per_split", None)
        super().finalize()


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def parse_blend(flag: str, values: list[str]) -> tuple[list[str], list[float] | None]:
    """Megatron-LM's blend list: ``["0.3", "A", "0.7", "B"]`` -> ``(["A", "B"], [0.3, 0.7])``,
    ``["A", "B"]`` -> ``(["A", "B"], None)``. A list that mixes the two forms is one ConfigError
    naming the entry (upstream asserts, or takes a stray weight for a prefix)."""
    if not values:
        raise ConfigError(flag, "needs at least one dataset prefix")
    numbers = [_number(v) for v in values]
    if all(n is None for n in numbers):
        return [v.strip() for v in values], None
    usage = "give weight-prefix pairs (0.3 A 0.7 B) or prefixes only (A B)"
    if len(values) % 2:
        stray = next(v for v, n in zip(values, numbers) if n is not None)
        raise ConfigError(flag, f"{stray!r} looks like a weight but the list is not pairs; {usage}")
    for weight, prefix, w in zip(values[0::2], values[1::2], numbers[0::2]):
        if w is None:
            raise ConfigError(flag, f"{weight!r} (before {prefix!r}) is not a number; {usage}")
        if not math.isfinite(w) or w <= 0:
            raise ConfigError(flag, f"weight {weight} of {prefix!r} must be a positive number")
    return [p.strip() for p in values[1::2]], [float(w) for w in numbers[0::2]]


def check_split(split: str) -> None:
    """``--split``: up to three non-negative train,valid,test weights, not all zero (a ConfigError
    otherwise, where upstream's parser would silently drop what is not a digit)."""
    parts = [p for p in split.replace(",", " ").split()]
    weights = [_number(p) for p in parts]
    usage = "give up to three non-negative train,valid,test weights, e.g. 969,30,1"
    if not 1 <= len(parts) <= 3 or any(w is None or not math.isfinite(w) or w < 0 for w in weights):
        raise ConfigError("--split", f"{split!r}: {usage}")
    if not sum(weights) > 0:
        raise ConfigError("--split", f"{split!r}: the weights are all zero; {usage}")
