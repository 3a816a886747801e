"""GPTModelProvider: a TransformerConfig that knows how to build this stage's GPTModel."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.transformer_config import TransformerConfig


def local_layer_spec(config: GPTModelProvider):
    """The layer spec of plain torch modules (megatron-core's "local" spec) for ``config``."""
    from megatron_lite.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=getattr(config, "qk_layernorm", False),
        normalization=config.normalization,
    )


def default_layer_spec(config: GPTModelProvider):
    """Upstream picks Transformer Engine's spec where it is installed; megatron_lite has the local one."""
    return local_layer_spec(config)


@dataclass(kw_only=True)
class GPTModelProvider(TransformerConfig):
    """A decoder-only GPT: GPT-2-shaped by default (learned positions, LayerNorm, GELU), Llama-shaped
    with rotary positions, RMSNorm, a gated SiLU MLP and grouped-query attention."""

    vocab_size: int = 1024
    """Vocabulary size before padding."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this times the tensor-parallel size, as Megatron does."""
    seq_length: int = 64
    """Training sequence length."""
    max_position_embeddings: int | None = None
    """Rows of the position-embedding table; None means seq_length."""
    position_embedding_type: str = "learned_absolute"
    """Positions: ``learned_absolute`` (a table on the first stage), ``rope`` (rotary) or ``none``."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that are rotated (rotary embeddings)."""
    rotary_base: int = 10000
    """Base of the rotary frequencies."""
    seq_len_interpolation_factor: float | None = None
    """Divide rotary positions by this factor (linear position interpolation); None for none."""
    rope_scaling: bool = False
    """Scale the rotary frequencies as Llama 3.x does (long wavelengths slowed by rope_scaling_factor)."""
    rope_scaling_factor: float = 8.0
    """Llama 3.x's rope scaling factor (8 for Llama 3.1, 32 for Llama 3.2)."""
    apply_rope_fusion: bool = False
    """Fused rotary embeddings (a CUDA kernel; not supported: False)."""
    calculate_per_token_loss: bool = False
    """Sum the loss over tokens and divide the gradients by the global batch's loss-token count (instead of
    averaging each microbatch's mean), so every loss token weighs the same: SFT packs give each example the
    loss it gets alone."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the word embedding."""
    deallocate_pipeline_outputs: bool = True
    """Free a stage's sent output right after sending (the 1F1B activation bound), as Megatron-Bridge."""
    gradient_accumulation_fusion: bool = True
    """Dense linear layers add their weight gradients straight into the fp32 ``main_grad``, as Megatron-LM's
    default and Megatron-Bridge's where the fused kernel exists (megatron_lite has it on every device);
    the fused loss (--cross-entropy-loss-fusion) always does."""
    init_seed: int = 1234
    """Seed of the layout-independent weight init (setup sets it from ``RNGConfig.seed``)."""
    # The layer spec, or a function of this provider giving it (upstream's field; megatron_lite builds its
    # layers from the config, the spec names the same local modules). Not a field: checkpoints pickle
    # the config's fields, and a function there is code a load would have to trust.
    transformer_layer_spec = staticmethod(default_layer_spec)
    # Fused kernels upstream turns on for imported models (Megatron-Bridge's field values). megatron_lite
    # computes the same results unfused, so they only record what the source asked for.
    bias_activation_fusion: bool = False
    """Fuse the MLP's bias add into its activation."""
    bias_dropout_fusion: bool = False
    """Fuse the bias add, dropout and residual add."""
    masked_softmax_fusion: bool = False
    """Fuse the attention mask into its softmax."""
    persist_layer_norm: bool = False
    """Apex's persistent layer-norm kernel."""
    attention_softmax_in_fp32: bool = False
    """Run the attention softmax in fp32 under bf16 / fp16."""
    # Groups the model is built with (parallel_state's when None); setup sets it, as upstream. A
    # plain class attribute, not a field: checkpoints store the config with ``asdict``, which would
    # try to copy process groups.
    _pg_collection = None
    _pre_wrap_hooks = ()  # likewise not a field: functions are not checkpointed

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def provide(self, pre_process=None, post_process=None, vp_stage=None) -> GPTModel:
        """This rank's stage of the GPT. ``pre_process`` (embedding) and ``post_process`` (output layer
        and loss) default to whether this is the first / last pipeline stage of the provider's groups."""
        vp_size = getattr(self, "virtual_pipeline_model_parallel_size", None)
        pg_collection = self._pg_collection
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        if pre_process is None:
            pre_process = is_vp_first_stage(vp_stage, vp_size) and is_pp_first_stage(pg_collection.pp)
        if post_process is None:
            post_process = is_vp_last_stage(vp_stage, vp_size) and is_pp_last_stage(pg_collection.pp)
        model = GPTModel(
            self,
            self.padded_vocab_size,
            self.max_position_embeddings or self.seq_length,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rotary_base,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            rope_scaling=self.rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            seed=self.init_seed,
            pg_collection=pg_collection,
            vp_stage=vp_stage,
        )
        for hook in self._pre_wrap_hooks:
            model = hook([model])[0]
        return model

    def provide_distributed_model(
        self, ddp_config=None, model_type=None, overlap_param_gather_with_optimizer_step: bool = False,
        fp16: bool | None = None, bf16: bool | None = None, use_megatron_fsdp: bool = False,
        use_torch_fsdp2: bool = False, wrap_with_ddp: bool = True, data_parallel_random_init: bool = True,
        use_cpu_initialization: bool | None = False, init_model_with_meta_device: bool | None = None,
        pre_wrap_hook=None, post_wrap_hook=None, mixed_precision_wrapper=None,
    ) -> list:  # fmt: skip
        """This rank's model chunks (one per virtual stage), each in megatron_lite's DDP over the
        data-parallel (with context-parallel) group unless ``wrap_with_ddp`` is False; Megatron-Bridge's
        call. The FSDP variants and mixed-precision wrappers are refused: megatron_lite has neither."""
        from megatron_lite.core.distributed import DistributedDataParallel

        if use_megatron_fsdp or use_torch_fsdp2 or init_model_with_meta_device:
            raise ValueError("provide_distributed_model: megatron_lite has no FSDP or meta-device init")
        if fp16 or bf16 or mixed_precision_wrapper is not None:
            raise ValueError("provide_distributed_model: set the provider's params_dtype (no Float16Module)")
        if use_cpu_initialization is not None:
            self.use_cpu_initialization = use_cpu_initialization
        vp = getattr(self, "virtual_pipeline_model_parallel_size", None)
        chunks = [self.provide(vp_stage=i if vp else None) for i in range(vp or 1)]
        if pre_wrap_hook is not None:
            chunks = pre_wrap_hook(chunks) or chunks
        if wrap_with_ddp:
            pg = self._pg_collection or ProcessGroupCollection.use_mpu_process_groups()
            chunks = [
                DistributedDataParallel(
                    self, c, dp_group=pg.dp_cp, ddp_config=ddp_config, expt_dp_group=pg.expt_dp
                )
                for c in chunks
            ]
        if post_wrap_hook is not None:
            chunks = post_wrap_hook(chunks) or chunks
        return chunks

    def register_pre_wrap_hook(self, hook) -> None:
        """Run ``hook(model_chunks) -> model_chunks`` on each model this provider builds, before it is
        wrapped for training (as Megatron-Bridge: AutoBridge loads Hugging Face weights this way)."""
        self._pre_wrap_hooks = [*self._pre_wrap_hooks, hook]
