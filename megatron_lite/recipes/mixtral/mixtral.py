"""Mixtral 8x7B pretraining, Megatron-Bridge's ``recipes/mixtral/mixtral.py`` as it stood at commit
f34e45377bdd9040ed05ca878354c2b01cc2686a (2025-11-12; upstream moved its Mixtral recipes out in
f28734a86 and has none at HEAD). Upstream builds it from keyword arguments over ``_mixtral_common``;
here the recommended values are set directly and a few keywords kept.

Left out, as megatron_lite lacks them: ``cross_entropy_fusion_impl="te"`` (Transformer Engine: native
here), manual garbage collection, Megatron-FSDP's sharding strategy, ``fully_parallel_save``,
communication overlap. Upstream also sets ``recompute_method="uniform"`` beside selective
recomputation, where nothing reads it; megatron_lite refuses a method without full recomputation,
so it stays None.
"""

from __future__ import annotations

from megatron_lite.recipes.architectures import model_config
from megatron_lite.recipes.architectures.mixtral import MIXTRAL_8X7B
from megatron_lite.recipes.common import default_output_dirs
from megatron_lite.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
from megatron_lite.recipes.utils.tokenizer_utils import DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
from megatron_lite.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    GPTDatasetConfig,
    LoggerConfig,
    RNGConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)
from megatron_lite.training.config.mixed_precision import bf16_mixed

HF_PATH = "mistralai/Mixtral-8x7B-v0.1"


def mixtral_8x7b_pretrain_config(use_null_tokenizer: bool = False, seq_length: int = 4096) -> ConfigContainer:
    """Mixtral 8x7B pretraining: tp 2, ep 4, sequence parallel, selective recomputation, seq 4096,
    GBS 32 of MBS 2, mock data. The tokenizer is upstream's Hugging Face one (``tokenizer_model`` must
    name a local directory here) unless ``use_null_tokenizer``."""
    checkpoint_dir, tensorboard_dir = default_output_dirs()
    model = model_config(MIXTRAL_8X7B)
    model.tensor_model_parallel_size, model.pipeline_model_parallel_size = 2, 1
    model.pipeline_dtype, model.virtual_pipeline_model_parallel_size = None, None
    model.context_parallel_size, model.sequence_parallel = 1, True
    model.expert_model_parallel_size, model.expert_tensor_parallel_size = 4, 1
    model.recompute_granularity, model.recompute_num_layers = "selective", None
    model.seq_length = seq_length
    model.cross_entropy_fusion_impl = "native"
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=500, lr_decay_iters=None, max_lr=3e-4, min_lr=3e-5
    )
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=300000, global_batch_size=32, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=500, eval_iters=32),  # upstream: the train spellings
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            average_in_collective=True,
            use_distributed_optimizer=True,
            use_megatron_fsdp=False,
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            sequence_length=seq_length,
            num_dataset_builder_threads=1,
            blend=None,  # mock data
            blend_per_split=None,
            split="1,1,1",
            dataloader_type="single",
        ),
        logger=LoggerConfig(
            log_interval=10,
            tensorboard_dir=tensorboard_dir,
            log_timers_to_tensorboard=True,
        ),
        tokenizer=TokenizerConfig(
            tokenizer_type="NullTokenizer" if use_null_tokenizer else "HuggingFaceTokenizer",
            tokenizer_model=None if use_null_tokenizer else HF_PATH,
            vocab_size=DEFAULT_NULL_TOKENIZER_VOCAB_SIZE if use_null_tokenizer else None,
            # The NullTokenizer's 32000 ids plus its end-of-document id outgrow Mixtral's 32000 rows:
            # the model takes the tokenizer's size, as upstream's set-up does.
            use_tokenizer_vocab_size=use_null_tokenizer,
        ),
        checkpoint=CheckpointConfig(
            save_interval=500,
            save=checkpoint_dir,
            load=checkpoint_dir,
            ckpt_format="torch_dist",
        ),
        rng=RNGConfig(seed=1234),
        comm_overlap=None,
        mixed_precision=bf16_mixed(),
    )
