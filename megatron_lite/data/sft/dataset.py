"""The SFT datasets: tokenized examples held as flat arrays, served one example per row
(``GPTSFTDataset``) or packed several per row (``GPTSFTPackedDataset``), both yielding the contract's
samples (packing.build_row).

Rows are drawn epoch after epoch until ``num_samples`` (Megatron-LM's SFTDataset wraps around its
indices the same way); each epoch visits every row once in an order drawn from ``seed`` and the epoch,
so a run is reproducible and resumes at any consumed-sample count.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megatron_lite.data.sft.examples import sft_error
from megatron_lite.data.sft.packing import aligned, build_row


@dataclass
class TokenizedExamples:
    """Examples' token ids and answer flags, concatenated: example i is ``ids[offsets[i]:offsets[i+1]]``."""

    ids: np.ndarray
    """int32, every example's ids one after another."""
    answer: np.ndarray
    """uint8, 1 where the id is answer text (learned), aligned with ids."""
    offsets: np.ndarray
    """int64 [n + 1]: where each example starts, then the end."""

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[i], self.offsets[i + 1]
        return self.ids[lo:hi], self.answer[lo:hi]

    @property
    def segment_lengths(self) -> np.ndarray:
        """Positions each example takes in a row (its ids less one)."""
        return np.diff(self.offsets) - 1

    @classmethod
    def from_list(cls, examples) -> TokenizedExamples:
        """From ``(ids, answer)`` pairs."""
        lengths = [len(ids) for ids, _ in examples]
        offsets = np.zeros(len(examples) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        if not examples:
            return cls(np.zeros(0, np.int32), np.zeros(0, np.uint8), offsets)
        ids = np.concatenate([np.asarray(i, np.int32) for i, _ in examples])
        answer = np.concatenate([np.asarray(a, np.uint8) for _, a in examples])
        return cls(ids, answer, offsets)

    def subset(self, indices) -> TokenizedExamples:
        return TokenizedExamples.from_list([self[int(i)] for i in indices])


@dataclass
class ExampleStats:
    """What happened to a file's examples, for its one summary line."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0


def fit_examples(tokenized, seq_length: int, truncation: str, pad_seq_to_mult: int = 1):
    """``TokenizedExamples`` of ``tokenized`` (``prompt.TokenizedExample``) that fit a row of
    ``seq_length``, and their stats. An example longer than the row is an error naming its line
    (``truncation="error"``) or is cut on the right to the row (``"right"``, Megatron-LM's); an example
    left with no answer token to learn is dropped (counted)."""
    kept, stats = [], ExampleStats()
    for example in tokenized:
        stats.examples += 1
        ids, answer = example.ids, example.answer
        if aligned(len(ids) - 1, pad_seq_to_mult) > seq_length:
            if truncation != "right":
                raise sft_error(
                    example.source,
                    f"the example is {len(ids)} tokens ({len(ids) - 1} positions), longer than the pack "
                    f"(--seq-length {seq_length}); "
                    "shorten it or give --sft-truncation right (cut on the right, as Megatron-LM)",
                )
            keep = seq_length - seq_length % pad_seq_to_mult + 1
            ids, answer = ids[:keep], answer[:keep]
            stats.truncated += 1
        if len(ids) < 2 or not answer[1:].any():
            stats.dropped += 1
            continue
        kept.append((ids, answer))
    return TokenizedExamples.from_list(kept), stats


class _SFTRows(torch.utils.data.Dataset):
    """Rows of ``seq_length``, each a list of example indices, drawn epoch by epoch."""

    def __init__(self, examples, rows, seq_length, pad_id, num_samples=None, seed=1234, pad_seq_to_mult=1):
        if not rows:
            raise ValueError("an SFT dataset needs at least one row")
        self.examples, self.rows = examples, rows
        self.seq_length, self.pad_id = seq_length, pad_id
        self.num_samples = len(rows) if num_samples is None else num_samples
        self.seed, self.pad_seq_to_mult = seed, pad_seq_to_mult
        self._order: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def _row(self, idx: int) -> int:
        epoch, position = divmod(idx, len(self.rows))
        if self._order is None or self._order[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order = (epoch, rng.permutation(len(self.rows)))
        return int(self._order[1][position])

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        members = self.rows[self._row(idx)]
        return build_row(
            [self.examples[i] for i in members], self.seq_length, self.pad_id, self.pad_seq_to_mult
        )

    def padding_tokens(self) -> int:
        """Positions per epoch that hold no example (alignment and tails)."""
        used = int(self.examples.segment_lengths.sum())
        return len(self.rows) * self.seq_length - used


class GPTSFTDataset(_SFTRows):
    """One example per row, padded to ``seq_length`` (Megatron-Bridge's unpacked GPTSFTDataset)."""

    def __init__(self, examples: TokenizedExamples, seq_length: int, pad_id: int, **kwargs):
        super().__init__(examples, [[i] for i in range(len(examples))], seq_length, pad_id, **kwargs)


class GPTSFTPackedDataset(_SFTRows):
    """Several examples per row (Megatron-Bridge's GPTSFTPackedDataset), ``packs`` of example indices as
    packing.pack_examples or an offline file (packed_file) gives them."""

    def __init__(self, examples: TokenizedExamples, packs, seq_length: int, pad_id: int, **kwargs):
        super().__init__(examples, [list(p) for p in packs], seq_length, pad_id, **kwargs)
