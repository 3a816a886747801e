"""GPTModel: the part of a GPT that one pipeline stage holds."""

from __future__ import annotations

import torch
from torch import nn

from megatron_lite.core import parallel_state
from megatron_lite.core.fusions.fused_linear_cross_entropy import output_layer_cross_entropy
from megatron_lite.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron_lite.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_lite.core.models.gpt.sharded_tensors import gpt_sharded_state_dict
from megatron_lite.core.packed_seq_params import PackedSeqParams, segment_boundaries
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel import ColumnParallelLinear, vocab_parallel_cross_entropy
from megatron_lite.core.transformer.transformer_block import TransformerBlock
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import init_method_normal, seeded_init


def _refuse_unsupported(
    fp16_lm_cross_entropy, logit_dtype, parallel_output, scatter_embedding_sp, mtp_block_spec
):
    """Upstream's arguments for features megatron_lite does not have: accepted at their defaults only."""
    for wanted, what in (
        (fp16_lm_cross_entropy, "fp16_lm_cross_entropy (the loss in half precision)"),
        (logit_dtype is not None, "logit_dtype"),
        (not parallel_output, "parallel_output=False (logits gathered over TP)"),
        (not scatter_embedding_sp, "scatter_embedding_sequence_parallel=False"),
        (mtp_block_spec is not None, "multi-token prediction (mtp_block_spec)"),
    ):
        if wanted:
            raise NotImplementedError(f"GPTModel: {what} is not supported by megatron_lite")


class GPTModel(nn.Module):
    """Embedding on the first stage (``pre_process``), this stage's layers, and on the last stage
    (``post_process``) the final norm, the output layer and the loss. With rotary positions every
    stage computes the rotation angles of its CP rank's positions for its own layers.

    With tied embeddings and more than one stage, the last stage holds its own copy of the word
    embedding (``output_layer.weight``, marked ``shared_embedding``) whose gradient is all-reduced
    with the first stage's over the embedding group, as Megatron does.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec=None,
        vocab_size: int | None = None,
        max_sequence_length: int | None = None,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        logit_dtype: torch.dtype | None = None,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool | None = None,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: float | None = None,
        mtp_block_spec=None,
        pg_collection: ProcessGroupCollection | None = None,
        vp_stage: int | None = None,
        *,
        seed: int = 1234,
    ):
        """Upstream's signature, ``GPTModel(config, transformer_layer_spec, vocab_size,
        max_sequence_length, ...)``: the spec chooses each layer's MLP; groups left unset are
        parallel_state's; the output layer is untied unless asked. megatron_lite's own older form,
        ``GPTModel(config, vocab_size, max_sequence_length, ...)`` (no spec: an int second), keeps its
        defaults: tied output layer, no groups unless given, layers from the config."""
        if transformer_layer_spec is None or isinstance(transformer_layer_spec, int):
            if isinstance(transformer_layer_spec, int):  # the older form, shifted by one place
                vocab_size, max_sequence_length = transformer_layer_spec, vocab_size
            transformer_layer_spec = None
            if share_embeddings_and_output_weights is None:
                share_embeddings_and_output_weights = True
        elif pg_collection is None and parallel_state.model_parallel_is_initialized():
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        share_embeddings_and_output_weights = bool(share_embeddings_and_output_weights)
        _refuse_unsupported(
            fp16_lm_cross_entropy,
            logit_dtype,
            parallel_output,
            scatter_embedding_sequence_parallel,
            mtp_block_spec,
        )
        super().__init__()
        self.vp_stage = vp_stage
        self.config = config
        self.pre_process, self.post_process = pre_process, post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.vocab_size = vocab_size
        # Kept whole so a forward step can find the model's groups (as upstream's get_pg_collection).
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        pp_group = pg_collection.pp if pg_collection is not None else None
        cp_group = pg_collection.cp if pg_collection is not None else None
        pp_rank = get_pg_rank(pp_group)
        self.input_tensor: torch.Tensor | None = None
        self.position_embedding_type = position_embedding_type

        if pre_process:
            with seeded_init(seed, "embedding"):
                self.embedding = LanguageModelEmbedding(
                    config,
                    vocab_size,
                    max_sequence_length,
                    position_embedding_type=position_embedding_type,
                    tp_group=self.tp_group,
                )
        if position_embedding_type == "rope":
            self.rotary_pos_emb = RotaryEmbedding(
                config.kv_channels,
                rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=cp_group,
            )
        self.transformer_layer_spec = transformer_layer_spec
        self.max_sequence_length = max_sequence_length
        self.decoder = TransformerBlock(
            config,
            transformer_layer_spec,
            pp_rank=pp_rank,
            vp_stage=vp_stage,
            post_process=post_process,
            seed=seed,
            tp_group=self.tp_group,
            cp_group=cp_group,
            pg_collection=pg_collection,
        )
        # --defer-embedding-wgrad-compute: the output layer's inputs and output gradients, kept from
        # each microbatch's forward and backward until the schedule drains their weight gradients.
        defer = post_process and config.defer_embedding_wgrad_compute
        self.embedding_activation_buffer = [] if defer else None
        self.grad_output_buffer = [] if defer else None
        if post_process:
            tied_elsewhere = share_embeddings_and_output_weights and pre_process
            # The same seed key as the embedding gives the last stage an identical copy of it.
            with seeded_init(seed, "embedding" if share_embeddings_and_output_weights else "output"):
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    vocab_size,
                    config=config,
                    init_method=init_method_normal(config.init_method_std),
                    bias=False,
                    skip_weight_param_allocation=tied_elsewhere,
                    embedding_activation_buffer=self.embedding_activation_buffer,
                    grad_output_buffer=self.grad_output_buffer,
                    tp_group=self.tp_group,
                )
            if share_embeddings_and_output_weights and not pre_process:
                self.output_layer.weight.shared = True
                self.output_layer.weight.shared_embedding = True
        if share_embeddings_and_output_weights and pre_process and post_process:
            # The output layer uses the embedding's weight too: its gradient must come in one sum.
            self.embedding.word_embeddings.weight_used_elsewhere = True
        if share_embeddings_and_output_weights and pre_process and not post_process:
            # Its gradient is all-reduced with the last stage's copy: the distributed optimizer must
            # shard both alike (param_and_grad_buffer gives each its own bucket).
            self.embedding.word_embeddings.weight.shared_embedding = True

    def set_input_tensor(self, input_tensor) -> None:
        """Give a non-first stage the activation received from the previous stage."""
        if isinstance(input_tensor, list):
            input_tensor = input_tensor[0]
        self.input_tensor = input_tensor

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Upstream's: ``{state-dict key: ShardedTensor}`` for ``dist_checkpointing.save`` / ``load``,
        in the layout-independent ``torch_dist`` layout (``sharded_tensors``)."""
        return gpt_sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ):
        """Returns the hidden states [s, b, h] on a non-last stage; on the last stage the per-token
        loss [b, s] when ``labels`` are given, else the vocab-parallel logits [s, b, v/tp].

        ``packed_seq_params`` (upstream's, thd): the row (micro batch size 1) packs several examples
        at its boundaries; every stage needs it (attention stays within each example, RoPE restarts
        at each). ``position_ids`` should restart at each example too (learned positions read them)."""
        hidden = self.embedding(input_ids, position_ids) if self.pre_process else self.input_tensor
        rotary_pos_emb = None
        if self.position_embedding_type == "rope":
            # The global sequence length: the input is split over CP ranks, and over TP ranks too
            # under sequence parallelism (attention sees the whole CP-local sequence).
            cp = self.pg_collection.cp if self.pg_collection is not None else None
            sp = get_pg_size(self.tp_group) if self.config.sequence_parallel else 1
            total = self.rotary_pos_emb.get_rotary_seq_len(hidden, get_pg_size(cp) * sp)
            if packed_seq_params is None:
                rotary_pos_emb = self.rotary_pos_emb(total)
            else:
                # Angles of positions up to the longest example; each token takes its own in attention.
                bounds = segment_boundaries(packed_seq_params, total)
                longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
                rotary_pos_emb = self.rotary_pos_emb(longest, packed_seq=True)
        hidden = self.decoder(hidden, rotary_pos_emb, packed_seq_params=packed_seq_params)
        if not self.post_process:
            return hidden
        weight = self.embedding.word_embeddings.weight if self.output_layer.weight is None else None
        if labels is not None and self.config.cross_entropy_loss_fusion:
            # The output layer and the loss over chunks of tokens: no [s, b, V/tp] logits at any instant.
            return output_layer_cross_entropy(
                self.output_layer, hidden, labels.transpose(0, 1).contiguous(), weight,
                self.config.cross_entropy_fusion_chunk_tokens,
            ).transpose(0, 1)  # fmt: skip
        logits, _ = self.output_layer(hidden, weight=weight)
        if labels is None:
            return logits
        # labels [b, s] -> [s, b] to match the logits, then back to [b, s].
        return vocab_parallel_cross_entropy(
            logits, labels.transpose(0, 1).contiguous(), tp_group=self.tp_group
        ).transpose(0, 1)
