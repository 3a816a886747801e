"""GPTModelProvider: a TransformerConfig that knows how to build this stage's GPTModel."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.transformer_config import TransformerConfig


@dataclass(kw_only=True)
class GPTModelProvider(TransformerConfig):
    """GPT with learned absolute positions, pre-LayerNorm blocks and a GELU MLP."""

    vocab_size: int = 1024
    """Vocabulary size before padding."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size, as Megatron does."""
    seq_length: int = 64
    """Training sequence length."""
    max_position_embeddings: int = 64
    """Rows of the position-embedding table."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding."""

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def provide(
        self,
        pg_collection: ProcessGroupCollection,
        *,
        pre_process: bool,
        post_process: bool,
        seed: int = 1234,
    ) -> GPTModel:
        return GPTModel(
            self,
            self.padded_vocab_size,
            self.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            seed=seed,
            pg_collection=pg_collection,
        )
