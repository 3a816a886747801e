"""GPT-2 small (124M) pretraining on a laptop's CPU: megatron_lite's own recipe, in upstream's naming
(``<model>_<task>_<devices><kind>_<precision>_config``). fp32 (most laptop CPUs have no bf16 matrix
units), one process, 256-token rows so that an iteration takes seconds, nanoGPT's GPT-2 learning rate
(6e-4 to 6e-5). Mock data by default; for real text give ``dataset.blend`` a preprocessed prefix and
``tokenizer.tokenizer_type=GPT2BPETokenizer`` with ``tokenizer.vocab_file`` / ``tokenizer.merge_file``."""

from __future__ import annotations

from megatron_lite.recipes.architectures import model_config
from megatron_lite.recipes.architectures.gpt2 import GPT2_SMALL
from megatron_lite.recipes.common import default_output_dirs
from megatron_lite.recipes.utils.optimizer_utils import distributed_fused_adam_with_cosine_annealing
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


def gpt2_124m_pretrain_1cpu_fp32_config() -> ConfigContainer:
    """GPT-2 small on one CPU process: seq 256, GBS 8 of MBS 4, 2000 iterations, fp32, mock data."""
    checkpoint_dir, tensorboard_dir = default_output_dirs()
    optimizer, scheduler = distributed_fused_adam_with_cosine_annealing(
        precision="32", lr_warmup_iters=100, lr_decay_iters=None, max_lr=6e-4, min_lr=6e-5
    )
    optimizer.use_distributed_optimizer = False  # one process: nothing to shard
    model = model_config(GPT2_SMALL)
    model.seq_length = 256
    return ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=2000, global_batch_size=8, micro_batch_size=4),
        validation=ValidationConfig(eval_interval=200, eval_iters=10),
        optimizer=optimizer,
        scheduler=scheduler,
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=False),
        dataset=GPTDatasetConfig(
            random_seed=1234,
            seq_length=256,
            blend=None,  # mock data
            split="969,30,1",
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=LoggerConfig(log_interval=10, tensorboard_dir=tensorboard_dir),
        # GPT-2's 50257 tokens: 50256 ids and the end-of-document id, as GPT-2's own tokenizer.
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=GPT2_SMALL["vocab_size"] - 1),
        checkpoint=CheckpointConfig(save_interval=500, save=checkpoint_dir),
        rng=RNGConfig(seed=1234),
        mixed_precision=None,  # fp32
    )
