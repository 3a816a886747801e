"""The configurations Megatron-Bridge's recipes start from (``megatron.bridge.recipes.common``):
``_pretrain_common``, ``_sft_common`` and ``_peft_common``, with upstream's values for every field
megatron_lite has. Each returns a ConfigContainer whose ``model`` the recipe sets.

Left out, as megatron_lite lacks them: ``train.manual_gc*`` (no manual garbage collection),
``ddp.data_parallel_sharding_strategy`` (no Megatron-FSDP), ``dataset.data_sharding`` /
``skip_getting_attention_mask_from_dataset`` (the loader always shards, masks are causal),
``checkpoint.fully_parallel_save`` (DCP writes each rank's shard). SFT and PEFT read SQuAD from the
Hugging Face hub upstream; here they read local JSONL (``dataset.data_path``, megatron_lite's
``--sft`` data), packed as upstream's default.
"""

from __future__ import annotations

import os

from megatron_lite.peft import LoRA
from megatron_lite.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
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


def default_output_dirs() -> tuple[str, str]:
    """(checkpoint dir, tensorboard dir) under ./nemo_experiments/default, upstream's defaults."""
    run_output_dir = os.path.join(os.getcwd(), "nemo_experiments", "default")
    return os.path.join(run_output_dir, "checkpoints"), os.path.join(run_output_dir, "tb_logs")


def _pretrain_common() -> ConfigContainer:
    """Pretraining defaults for any language model: mock data (``dataset.blend`` None), distributed
    Adam with cosine decay (3e-4 to 3e-5, 500 warmup iterations), bf16 mixed precision."""
    checkpoint_dir, tensorboard_dir = default_output_dirs()
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=500, lr_decay_iters=None, max_lr=3e-4, min_lr=3e-5
    )
    return ConfigContainer(
        model=None,  # set by each recipe
        train=TrainingConfig(train_iters=300000, global_batch_size=32, micro_batch_size=2),
        validation=ValidationConfig(eval_interval=500, eval_iters=32),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(
            check_for_nan_in_grad=True,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            average_in_collective=True,
            use_distributed_optimizer=True,
        ),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            reset_attention_mask=False,
            reset_position_ids=False,
            eod_mask_loss=False,
            seq_length=4096,
            num_dataset_builder_threads=1,
            blend=None,  # mock data
            blend_per_split=None,
            split="9999,8,2",
            dataloader_type="single",
        ),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=tensorboard_dir, log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(
            tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None, use_tokenizer_vocab_size=True
        ),
        checkpoint=CheckpointConfig(
            save_interval=500, save=checkpoint_dir, load=checkpoint_dir, ckpt_format="torch_dist"
        ),
        rng=RNGConfig(seed=1234),
        dist=DistributedInitConfig(),
        comm_overlap=None,
        mixed_precision="bf16_mixed",
    )


def _sft_dataset(seq_length: int):
    """Packed fine-tuning rows of local JSONL (upstream: SQuAD, packed, pad_seq_to_mult 1)."""
    from megatron_lite.data.sft.config import SFTDatasetConfig

    return SFTDatasetConfig(seq_length=seq_length, data_path=None, packing=True, pad_seq_to_mult=1)


def _finetune_common(max_lr: float, peft: LoRA | None) -> ConfigContainer:
    checkpoint_dir, tensorboard_dir = default_output_dirs()
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        lr_warmup_iters=50, lr_decay_iters=None, max_lr=max_lr, min_lr=0.0, adam_beta2=0.98
    )
    return ConfigContainer(
        model=None,  # set by each recipe
        train=TrainingConfig(train_iters=1000, global_batch_size=128, micro_batch_size=1),
        validation=ValidationConfig(eval_interval=100, eval_iters=32),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(check_for_nan_in_grad=True, grad_reduce_in_fp32=True),
        dataset=_sft_dataset(2048),
        logger=LoggerConfig(log_interval=1, tensorboard_dir=tensorboard_dir, log_timers_to_tensorboard=True),
        tokenizer=TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=None),
        checkpoint=CheckpointConfig(
            save_interval=100,
            save=checkpoint_dir,
            load=checkpoint_dir,
            pretrained_checkpoint=None,
            ckpt_format="torch_dist",
        ),
        rng=RNGConfig(seed=5678),
        dist=DistributedInitConfig(),
        comm_overlap=None,
        mixed_precision="bf16_mixed",
        peft=peft,
    )


def _sft_common() -> ConfigContainer:
    """Full fine-tuning defaults: every weight trains at 5e-6 (cosine to 0, 50 warmup iterations,
    Adam beta2 0.98), 1000 iterations of 128 packed 2048-token rows, seed 5678."""
    return _finetune_common(max_lr=5e-6, peft=None)


def _peft_common() -> ConfigContainer:
    """LoRA defaults: rank 32, alpha 32 on every linear layer of the blocks, trained at 1e-4;
    otherwise as :func:`_sft_common`."""
    lora = LoRA(
        target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"],
        dim=32,
        alpha=32,
        dropout=0.0,
        dropout_position="pre",
        lora_A_init_method="xavier",
        lora_B_init_method="zero",
        a2a_experimental=False,
        lora_dtype=None,  # the model's dtype
    )
    return _finetune_common(max_lr=1e-4, peft=lora)
