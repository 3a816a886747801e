"""Vanilla GPT (Megatron-Bridge's ``recipes/gpt/h100/vanilla_gpt.py``): a bare GPTModelProvider at
its defaults and Megatron-LM ``pretrain_gpt.py``'s training defaults, so that only what the command
line overrides differs between the two frameworks. Upstream's bare provider has no size (megatron-core
leaves num_layers / hidden_size / heads at 0: the command line gives them); megatron_lite's defaults
(8 layers, hidden 256, 8 heads) stand in, and upstream's provider defaults that megatron_lite's differ
from are set here (seq_length 1024, vocab_size None, the masked-softmax and loss fusions, rope scaling factor 1)."""

from __future__ import annotations

from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.recipes.common import default_output_dirs
from megatron_lite.recipes.utils.environment_utils import COMMON_RECIPE_ENV_VARS
from megatron_lite.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
from megatron_lite.recipes.utils.tokenizer_utils import DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
from megatron_lite.training.config import (
    CheckpointConfig,
    ConfigContainer,
    DistributedDataParallelConfig,
    DistributedInitConfig,
    GPTDatasetConfig,
    LoggerConfig,
    RNGConfig,
    TokenizerConfig,
    TrainingConfig,
    ValidationConfig,
)


def vanilla_gpt_pretrain_1gpu_h100_bf16_config() -> ConfigContainer:
    """A plain GPT on one GPU: seq 1024, GBS 32 of MBS 2, no distributed optimizer, mock data."""
    checkpoint_dir, tensorboard_dir = default_output_dirs()
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=500, lr_decay_iters=None, max_lr=3e-4, min_lr=3e-5
    )
    model = GPTModelProvider(
        seq_length=1024,
        vocab_size=None,  # the tokenizer's
        masked_softmax_fusion=True,
        cross_entropy_loss_fusion=True,
        rope_scaling_factor=1.0,
    )
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=300000, global_batch_size=32, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=500, eval_iters=32),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            use_distributed_optimizer=False,
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            seq_length=1024,
            blend=None,  # mock data
            blend_per_split=None,
            split="9999,8,2",
            dataloader_type="single",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=tensorboard_dir),
        tokenizer=TokenizerConfig(
            tokenizer_type="NullTokenizer", vocab_size=DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
        ),
        checkpoint=CheckpointConfig(save_interval=500, save=checkpoint_dir, ckpt_format="torch_dist"),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        mixed_precision="bf16_mixed",
    )
    cfg.env_vars = {**COMMON_RECIPE_ENV_VARS}
    return cfg
