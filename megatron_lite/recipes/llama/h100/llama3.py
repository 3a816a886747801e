"""Llama 3 recipes for H100 (Megatron-Bridge's ``recipes/llama/h100/llama3.py``), named as upstream:
``<model>_<task>_<gpus>gpu_h100_bf16_config``. Every field megatron_lite has is upstream's value.

Left out, as megatron_lite lacks them: Transformer Engine (``transformer_impl``, ``attention_backend``;
the loss fusion's ``te`` kernel becomes ``native``), CUDA graphs (``cuda_graph_*``), activation
offloading (``fine_grained_activation_offloading``, ``offload_modules``), the optimizer's state dtypes
(``main_grads_dtype`` ...: fp32 here, as upstream), manual garbage collection (``train.manual_gc*``),
userbuffer communication overlap (``comm_overlap``), Megatron-FSDP (``ddp.data_parallel_sharding_strategy``)
and fp8. Upstream's fine-tuning recipes also set ``scheduler.max_lr``, which is not a scheduler field
(the optimizer's ``lr`` is the peak); it is not copied. Upstream sets ``recompute_modules = None``
after building the model, with no recomputation; megatron_lite keeps the model's own default
(``["core_attn"]``, what a saved config reloads as from None), which nothing reads without selective
recomputation.
"""

from __future__ import annotations

import torch

from megatron_lite.peft import LoRA
from megatron_lite.recipes.architectures import model_config
from megatron_lite.recipes.architectures.llama import META_LLAMA_3_8B, META_LLAMA_3_70B
from megatron_lite.recipes.common import _peft_common, _pretrain_common, _sft_common
from megatron_lite.recipes.utils.environment_utils import COMMON_RECIPE_ENV_VARS
from megatron_lite.recipes.utils.tokenizer_utils import DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.config.mixed_precision import bf16_mixed


def _set_layout(
    cfg: ConfigContainer, tp: int, pp: int, vp: int | None, cp: int, sp: bool, pipeline_dtype=None
):
    m = cfg.model
    m.tensor_model_parallel_size, m.pipeline_model_parallel_size = tp, pp
    m.pipeline_model_parallel_layout, m.pipeline_dtype = None, pipeline_dtype
    m.virtual_pipeline_model_parallel_size, m.context_parallel_size, m.sequence_parallel = vp, cp, sp


def _llama3_pretrain(hf_config: dict, **layout) -> ConfigContainer:
    """What every Llama 3 H100 pretraining recipe sets: NullTokenizer on mock data, 8192 tokens,
    GBS 512 of MBS 1, distributed optimizer, overlapped gradient reduce and parameter gather."""
    cfg = _pretrain_common()
    cfg.model = model_config(hf_config)
    cfg.tokenizer.tokenizer_type = "NullTokenizer"
    cfg.tokenizer.tokenizer_model = None
    cfg.tokenizer.vocab_size = DEFAULT_NULL_TOKENIZER_VOCAB_SIZE
    cfg.dataset.blend = None  # mock data; a blend of real data replaces it
    cfg.dataset.num_workers = 8
    cfg.dataset.seq_length = 8192
    _set_layout(cfg, **layout)
    cfg.model.seq_length = 8192
    cfg.train.train_iters = 1168251
    cfg.train.global_batch_size = 512
    cfg.train.micro_batch_size = 1
    cfg.validation.eval_interval = 2000
    cfg.scheduler.lr_warmup_iters = 2000
    cfg.logger.log_timers_to_tensorboard = True
    cfg.model.cross_entropy_loss_fusion = True
    cfg.model.cross_entropy_fusion_impl = "native"  # upstream: "te" (Transformer Engine's kernel)
    cfg.model.recompute_granularity = None
    cfg.optimizer.use_precision_aware_optimizer = False
    cfg.checkpoint.save_interval = 500
    d = cfg.ddp
    d.overlap_grad_reduce, d.overlap_param_gather, d.check_for_nan_in_grad = True, True, True
    d.use_distributed_optimizer, d.use_megatron_fsdp = True, False
    d.grad_reduce_in_fp32, d.average_in_collective = True, True
    cfg.env_vars = {**COMMON_RECIPE_ENV_VARS}
    return cfg


def llama3_8b_pretrain_2gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 8B pretraining on 2 H100s: tp 1, pp 1, cp 2, seq 8192."""
    return _llama3_pretrain(META_LLAMA_3_8B, tp=1, pp=1, vp=None, cp=2, sp=False)


def llama3_70b_pretrain_32gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 70B pretraining on 32 H100s: tp 4, pp 4, vp 5, cp 2, sequence parallel, seq 8192
    (upstream adds userbuffer TP communication overlap, which megatron_lite lacks)."""
    cfg = _llama3_pretrain(META_LLAMA_3_70B, tp=4, pp=4, vp=5, cp=2, sp=True, pipeline_dtype=torch.bfloat16)
    cfg.mixed_precision = bf16_mixed()
    return cfg


def _llama3_finetune(
    cfg: ConfigContainer, hf_config: dict, hf_path: str, tp: int, pp: int = 1
) -> ConfigContainer:
    """What Llama 3's SFT and PEFT recipes share: 4096-token packed rows, GBS 8 of MBS 1, no
    distributed optimizer, no overlap, seed 5678."""
    cfg.model = model_config(hf_config)
    cfg.tokenizer.tokenizer_model = hf_path  # a local directory here: the hub is not read
    cfg.model.seq_length = 4096
    cfg.dataset.seq_length = 4096
    _set_layout(cfg, tp=tp, pp=pp, vp=None, cp=1, sp=False)
    cfg.mixed_precision = "bf16_mixed"
    cfg.train.train_iters = 1000
    cfg.validation.eval_interval = 30
    cfg.validation.eval_iters = 32
    cfg.train.global_batch_size = 8
    cfg.train.micro_batch_size = 1
    cfg.logger.log_interval = 1
    cfg.optimizer.adam_beta2 = 0.98
    cfg.optimizer.use_precision_aware_optimizer = False
    cfg.scheduler.lr_warmup_iters = 50
    cfg.model.cross_entropy_fusion_impl = "native"
    cfg.model.recompute_granularity = None
    cfg.checkpoint.save_interval = 50
    cfg.checkpoint.ckpt_format = "torch_dist"
    d = cfg.ddp
    d.overlap_grad_reduce, d.overlap_param_gather, d.check_for_nan_in_grad = False, False, True
    d.use_distributed_optimizer, d.grad_reduce_in_fp32 = False, False
    cfg.rng.seed = 5678
    cfg.env_vars = {**COMMON_RECIPE_ENV_VARS}
    return cfg


def llama3_8b_sft_2gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 8B full fine-tuning on 2 H100s: tp 2, every weight trains at 5e-6."""
    cfg = _llama3_finetune(_sft_common(), META_LLAMA_3_8B, "meta-llama/Meta-Llama-3-8B", tp=2)
    cfg.model.cross_entropy_loss_fusion = True
    return cfg


def llama3_70b_sft_32gpu_h100_bf16_config() -> ConfigContainer:
    """Llama 3 70B full fine-tuning on 32 H100s: tp 8, pp 4, every weight trains at 5e-6."""
    cfg = _llama3_finetune(_sft_common(), META_LLAMA_3_70B, "meta-llama/Meta-Llama-3-70B", tp=8, pp=4)
    cfg.model.cross_entropy_loss_fusion = True
    return cfg


def _lora(dim: int, alpha: int) -> LoRA:
    lora = _peft_common().peft
    lora.dim, lora.alpha = dim, alpha
    return lora


def _llama3_peft(
    hf_config: dict, hf_path: str, tp: int, dim: int, alpha: int, peft_scheme
) -> ConfigContainer:
    cfg = _llama3_finetune(_peft_common(), hf_config, hf_path, tp=tp)
    if isinstance(peft_scheme, str):
        if peft_scheme.lower() != "lora":
            raise ValueError(f"peft_scheme {peft_scheme!r}: megatron_lite has LoRA only (upstream also DoRA)")
        cfg.peft = _lora(dim, alpha)
    else:
        cfg.peft = peft_scheme
    cfg.optimizer.use_distributed_optimizer = False
    cfg.model.cross_entropy_loss_fusion = False
    return cfg


def llama3_8b_peft_1gpu_h100_bf16_config(peft_scheme: str | LoRA = "lora") -> ConfigContainer:
    """Llama 3 8B LoRA (rank 8, alpha 16) on one H100."""
    return _llama3_peft(META_LLAMA_3_8B, "meta-llama/Meta-Llama-3-8B", 1, 8, 16, peft_scheme)


def llama3_70b_peft_8gpu_h100_bf16_config(peft_scheme: str | LoRA = "lora") -> ConfigContainer:
    """Llama 3 70B LoRA (rank 16, alpha 32) on 8 H100s: tp 8."""
    return _llama3_peft(META_LLAMA_3_70B, "meta-llama/Meta-Llama-3-70B", 8, 16, 32, peft_scheme)
