"""``SFTDatasetConfig``: the dataset section ``--sft`` builds (Megatron-LM's SFT data, with
Megatron-Bridge's packed-sequence settings). It is a DatasetProvider, so the run's data set-up builds
its datasets through ``build_datasets``; ``check_inputs`` reads every file first (the validation, in
the launcher before any worker starts), so bad input is one line naming file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.core.datasets.blended_megatron_dataset_config import (
    convert_split_vector_to_split_matrix,
    parse_and_normalize_split,
)
from megatron_lite.data.base import DatasetBuildContext, DatasetProvider
from megatron_lite.data.sft import build
from megatron_lite.data.sft.dataset import GPTSFTPackedDataset, TokenizedExamples
from megatron_lite.data.sft.packed_file import is_packed_file
from megatron_lite.data.sft.packing import PACKING_ALGOS
from megatron_lite.training.errors import ConfigError
from megatron_lite.utils.common_utils import print_rank_0

TRUNCATIONS = ("error", "right")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@dataclass(kw_only=True)
class SFTDatasetConfig(DatasetProvider):
    """Supervised fine-tuning data: JSONL of conversations or input / output pairs, or packs made by
    tools/prepare_sft_data.py."""

    seq_length: int | None = None
    """Positions per row (the pack size; must equal the model's seq_length)."""
    data_path: str | list[str] | None = None
    """JSONL files of ``messages`` (Megatron-LM) or ``input`` / ``output`` (Megatron-Bridge), or pack
    files (``.safetensors``) from tools/prepare_sft_data.py; read one after another, then --split."""
    split: str | None = None
    """train,valid,test weights dividing the examples (the packs of a pack file) in file order."""
    blend_per_split: list | None = None
    """Per-split files (--train-data-path / --valid-data-path / --test-data-path), instead of split."""
    packing: bool = True
    """Pack several examples into each row (attending only within each); else one example per row."""
    packing_algorithm: str = "first_fit_decreasing"
    """How examples are packed: first_fit_decreasing or first_fit_shuffle (Megatron-Bridge's)."""
    pad_seq_to_mult: int | None = None
    """Pad each example's segment to a multiple of this (Megatron-Bridge's CP / SP alignment); None:
    derived from the layout (lcm of 2 cp with context parallelism, tp x cp with sequence parallelism)."""
    truncation: str = "error"
    """An example longer than a row: error (one line naming file and line) or right (cut on the
    right, as Megatron-LM)."""
    use_chat_template: bool = True
    """Render conversations with the tokenizer's chat template when it has one (else the default format)."""
    random_seed: int = 1234
    """Seed of each epoch's row order and of first_fit_shuffle."""
    split_matrix: list | None = field(default=None, init=False, repr=False)

    @property
    def sft(self) -> bool:
        """Megatron-LM's args.sft: the batches carry each example's boundaries (cu_seqlens)."""
        return True

    def finalize(self) -> None:
        if not self.data_path and not self.blend_per_split:
            raise ConfigError("--data-path", "--sft needs the JSONL (or pack) files to train on")
        if isinstance(self.data_path, str):
            self.data_path = self.data_path.split()
        for paths, weights in [(self.data_path, None)] + [b for b in self.blend_per_split or [] if b]:
            if weights is not None or any(_is_number(p) for p in paths or []):
                raise ConfigError(
                    "--data-path",
                    "--sft reads its files one after another; weighted blends are not supported yet",
                )
        if self.packing_algorithm not in PACKING_ALGOS:
            raise ConfigError(
                "--sft-packing-algorithm",
                f"{self.packing_algorithm!r}: choose from {', '.join(PACKING_ALGOS)}",
            )
        if self.truncation not in TRUNCATIONS:
            raise ConfigError(
                "--sft-truncation", f"{self.truncation!r}: choose from {', '.join(TRUNCATIONS)}"
            )
        if self.pad_seq_to_mult is not None and self.pad_seq_to_mult < 1:
            raise ConfigError(
                "--sft-pad-seq-to-mult", f"must be a positive integer (got {self.pad_seq_to_mult})"
            )
        if self.split is not None and self.blend_per_split is None:
            self.split_matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(self.split))
        DatasetProvider.finalize(self)

    def _split_files(self) -> list[list[str] | None]:
        if self.blend_per_split is not None:
            return [None if b is None else list(b[0]) for b in self.blend_per_split]
        return [list(self.data_path)] + [None, None]

    def _load(self, paths: list[str], tokenizer, announce: bool):
        """Examples and rows of ``paths`` together (all JSONL, or all pack files)."""
        packed = [is_packed_file(p) for p in paths]
        if any(packed) and not all(packed):
            raise ConfigError("--data-path", "give JSONL files or pack files, not both")
        s, mult = self.seq_length, self.pad_seq_to_mult or 1
        if all(packed):
            parts, rows, base = [], [], 0
            for path in paths:
                examples, packs = build.load_pack_file(path, tokenizer, s, mult)
                parts.append(examples)
                rows += (
                    [[base + i for i in p] for p in packs]
                    if self.packing
                    else [[base + i] for p in packs for i in p]
                )
                base += len(examples)
            return build.concatenate(parts) if len(parts) > 1 else parts[0], rows, True
        parts = []
        for path in paths:
            examples, stats, renderer = build.load_jsonl(
                path, tokenizer, s, self.truncation, mult, self.use_chat_template
            )
            if announce:
                print_rank_0(build.summary_line(path, stats, s, renderer))
            parts.append(examples)
        return build.concatenate(parts) if len(parts) > 1 else parts[0], None, False

    def _split_datasets(self, tokenizer, announce: bool) -> list[tuple[TokenizedExamples, list] | None]:
        """Each split's (examples, rows), or None."""
        files = self._split_files()
        if self.blend_per_split is None:
            examples, rows, from_packs = self._load(files[0], tokenizer, announce)
            n = len(rows) if from_packs else len(examples)
            out = []
            for r in build.split_ranges(n, self.split_matrix or [(0.0, 1.0), None, None]):
                if r is None or not len(r):
                    out.append(None)
                elif from_packs:
                    out.append(build.restrict(examples, [rows[i] for i in r]))
                else:
                    part = examples.subset(r)
                    out.append((part, build.rows_for(part, self)))
            return out
        out = []
        for paths in files:
            if paths is None:
                out.append(None)
                continue
            examples, rows, from_packs = self._load(paths, tokenizer, announce)
            out.append((examples, rows if from_packs else build.rows_for(examples, self)))
        return out

    def check_inputs(self, tokenizer) -> None:
        """Read, render and tokenize every file (the validation before any worker starts)."""
        splits = self._split_datasets(tokenizer, announce=False)
        if splits[0] is None:
            raise ConfigError("--split", f"{self.split!r} leaves the training split without examples")

    def build_datasets(self, context: DatasetBuildContext):
        tokenizer = context.tokenizer
        if tokenizer is None:
            raise ConfigError("--tokenizer-type", "--sft needs the run's tokenizer")
        sizes = (context.train_samples, context.valid_samples, context.test_samples)
        datasets = []
        for i, (split, n) in enumerate(zip(self._split_datasets(tokenizer, announce=True), sizes)):
            if split is None or not n:
                datasets.append(None)
                continue
            examples, rows = split
            datasets.append(
                GPTSFTPackedDataset(
                    examples,
                    rows,
                    self.seq_length,
                    tokenizer.eod,
                    num_samples=n,
                    seed=self.random_seed + i,
                    pad_seq_to_mult=self.pad_seq_to_mult or 1,
                )
            )
            if i == 0:
                kind = f"packs ({self.packing_algorithm})" if self.packing else "rows of one example"
                padding = datasets[-1].padding_tokens() / (len(rows) * self.seq_length)
                print_rank_0(
                    f"> SFT train: {len(examples)} examples in {len(rows)} {kind} of {self.seq_length} "
                    f"positions, {padding:.1%} padding"
                )
        return tuple(datasets)
