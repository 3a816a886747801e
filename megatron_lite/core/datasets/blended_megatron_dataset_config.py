"""Dataset configs of megatron.core.datasets: what data to draw and how sequences are shaped.

megatron_lite draws only synthetic (mock) data so far: a config without ``blend`` or
``blend_per_split`` is mock, as upstream; real indexed datasets are a later feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class BlendedMegatronDatasetConfig:
    """Where samples come from and how long they are."""

    random_seed: int
    """Seed of every random choice made while building the datasets."""
    sequence_length: int
    """Tokens per sample."""
    blend: tuple[list[str], list[float] | None] | None = None
    """Dataset prefixes and optional weights (real data: not supported yet)."""
    blend_per_split: list | None = None
    """One blend per train/valid/test split (real data: not supported yet)."""
    split: str | None = None
    """Comma-separated train,valid,test weights; mock data uses an even "1,1,1"."""
    split_matrix: list[tuple[float, float]] | None = field(init=False, default=None)
    """Derived from ``split``: the [begin, end) fraction of each split."""
    num_dataset_builder_threads: int = 1
    """Threads building the datasets."""
    path_to_cache: str | None = None
    """Where reusable dataset indices are cached."""
    mmap_bin_files: bool = True
    """Memory-map the .bin files."""
    mock: bool = field(init=False, default=False)
    """Derived: True when neither ``blend`` nor ``blend_per_split`` is given."""
    tokenizer: object | None = None
    """Tokenizer for datasets that tokenize online (mock data does not)."""

    def __post_init__(self) -> None:
        self.mock = self.blend is None and not any(self.blend_per_split or [])
        if self.mock and self.split is None:
            self.split = "1,1,1"
        if self.split is not None and not any(self.blend_per_split or []):
            weights = [float(x) for x in self.split.split(",")]
            weights += [0.0] * (3 - len(weights))
            total = sum(weights)
            bounds, start = [], 0.0
            for w in weights:
                bounds.append((start, start + w / total))
                start += w / total
            self.split_matrix = bounds


@dataclass(kw_only=True)
class GPTDatasetConfig(BlendedMegatronDatasetConfig):
    """GPT-specific sample shaping: position ids, attention mask and loss mask."""

    reset_position_ids: bool | None = None
    """Restart position ids after each end-of-document token."""
    reset_attention_mask: bool | None = None
    """Block attention across end-of-document tokens."""
    eod_mask_loss: bool | None = None
    """Exclude end-of-document tokens from the loss."""
    create_attention_mask: bool = True
    """Build the attention mask in the dataset (else the attention derives it)."""
    add_extra_token_to_sequence: bool = True
    """Draw sequence_length + 1 tokens so inputs and labels are both sequence_length long."""
