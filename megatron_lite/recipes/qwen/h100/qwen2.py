"""Qwen2 recipes for H100 (Megatron-Bridge's ``recipes/qwen/h100/qwen2.py``). Left out, as in the
Llama recipes (``llama/h100/llama3.py``): Transformer Engine, CUDA graphs, activation offloading,
the optimizer's state dtypes, manual garbage collection, Megatron-FSDP's sharding strategy, fp8;
``recompute_modules`` keeps the model's default, as there."""

from __future__ import annotations

from megatron_lite.recipes.architectures import model_config
from megatron_lite.recipes.architectures.qwen import QWEN2_7B
from megatron_lite.recipes.common import _pretrain_common
from megatron_lite.recipes.utils.environment_utils import COMMON_RECIPE_ENV_VARS
from megatron_lite.recipes.utils.tokenizer_utils import DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
from megatron_lite.training.config import ConfigContainer


def qwen2_7b_pretrain_2gpu_h100_bf16_config() -> ConfigContainer:
    """Qwen2 7B pretraining on 2 H100s: tp 2, seq 4096, GBS 32 of MBS 2, NullTokenizer, mock data."""
    cfg = _pretrain_common()
    cfg.model = model_config(QWEN2_7B)
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
    cfg.dataset.blend = None  # mock data; a blend of real data replaces it
    cfg.dataset.num_workers = 8
    m = cfg.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = 2, 1
    m.pipeline_model_parallel_layout, m.pipeline_dtype = None, None
    m.virtual_pipeline_model_parallel_size, m.context_parallel_size, m.sequence_parallel = None, 1, False
    m.seq_length = 4096
    m.init_method_std = 0.02
    m.cross_entropy_loss_fusion = True
    m.cross_entropy_fusion_impl = "native"
    m.recompute_granularity = None
    cfg.optimizer.use_precision_aware_optimizer = False
    d = cfg.ddp
    d.use_megatron_fsdp, d.overlap_grad_reduce, d.overlap_param_gather = False, False, False
    d.average_in_collective, d.grad_reduce_in_fp32, d.check_for_nan_in_grad = False, False, False
    d.use_distributed_optimizer = True
    cfg.env_vars = {**COMMON_RECIPE_ENV_VARS}
    return cfg
