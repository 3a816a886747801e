"""What a megatron_lite ``torch_dist`` checkpoint holds for Megatron-LM, so that Megatron-LM's
``load_checkpoint`` (megatron/training/checkpointing.py) resumes it. Its tensors already are
megatron-core's (model and optimizer, key for key); its common state adds, beside ours:

- ``args``, an ``argparse.Namespace`` (one of Megatron-LM's SAFE_GLOBALS; ours reads it back as plain
  data): ``check_checkpoint_args`` compares ``num_layers``, ``hidden_size``, ``num_attention_heads``,
  ``add_position_embedding`` (with a vocab file also ``max_position_embeddings``,
  ``make_vocab_size_divisible_by``, ``tokenizer_type``); ``load_checkpoint`` reads the tensor and pipeline
  sizes, ``data_parallel_size``, ``world_size``, ``no_save_optim``, ``no_save_rng`` and the consumed /
  skipped samples; ``--use-checkpoint-args`` copies the architecture (``load_args_from_checkpoint``'s fields).
- ``num_floating_point_operations_so_far``; ``checkpoint_version`` 3.0, ``iteration`` and
  ``opt_param_scheduler`` (megatron-core's OptimizerParamScheduler state) are ours already.
- the optimizer's common part as megatron-core's optimizers load it: ``FP32Optimizer``'s param groups
  with the keys it matches groups by (``wd_mult``, ``lr_mult``, ``is_expert_parallel``,
  ``is_decoupled_lr``) and ``state.common_step``; ``Float16OptimizerWithFloat16Params``' the same under
  ``optimizer``.

- with the distributed optimizer, its state as megatron-core's ``DistributedOptimizer`` saves the
  ``fully_reshardable`` form (every parameter's fp32 main weights under ``optimizer.state.param.``, the
  groups with the step in each under ``optimizer``, ``param_state_sharding_type``), and
  ``content_metadata`` saying so: Megatron-LM lays out its load's request by it.

- a MoE model's optimizer as Megatron-LM's chained one (the dense parameters', the experts'), one
  state per part.

Not written, and said so to Megatron-LM: its RNG states (``no_save_rng`` True, so its load skips them).
"""

from __future__ import annotations

import argparse

import torch

from megatron_lite.training.checkpointing.megatron_lm import RENAMED, SAME

_IDENTIFIERS = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}


def megatron_lm_args(cfg, train_state, world_size: int, data_parallel_size: int) -> argparse.Namespace:
    """This run as Megatron-LM's parsed command line (its argument names)."""
    m = cfg.model
    args = {name: getattr(m, name) for name in SAME if hasattr(m, name)}
    args |= {theirs: getattr(m, ours) for theirs, ours in RENAMED.items() if hasattr(m, ours)}
    activation = getattr(m.activation_func, "__name__", str(m.activation_func))
    args |= {
        "group_query_attention": m.num_query_groups not in (None, m.num_attention_heads),
        "num_query_groups": m.num_query_groups or m.num_attention_heads,
        "swiglu": bool(m.gated_linear_unit) and activation == "silu",
        "squared_relu": activation == "squared_relu",
        "openai_gelu": activation == "openai_gelu",
        "untie_embeddings_and_output_weights": not m.share_embeddings_and_output_weights,
        "add_position_embedding": m.position_embedding_type == "learned_absolute",
        "vocab_size": m.vocab_size,
        "padded_vocab_size": m.padded_vocab_size,
        "bf16": bool(m.bf16),
        "fp16": bool(m.fp16),
        "world_size": world_size,
        "data_parallel_size": data_parallel_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "global_batch_size": cfg.train.global_batch_size,
        "train_iters": cfg.train.train_iters,
        "lr": cfg.optimizer.lr,
        "min_lr": cfg.optimizer.min_lr,
        "weight_decay": cfg.optimizer.weight_decay,
        "lr_decay_style": cfg.scheduler.lr_decay_style,
        "seed": cfg.rng.seed,
        "use_distributed_optimizer": cfg.optimizer.use_distributed_optimizer,
        "tokenizer_type": cfg.tokenizer.tokenizer_type,
        "ckpt_format": "torch_dist",
        "no_save_optim": False,
        "no_save_rng": True,  # ours are not Megatron-LM's per-(pp, tp) RNG objects: its load skips them
        "consumed_train_samples": train_state.consumed_train_samples,
        "skipped_train_samples": train_state.skipped_train_samples,
        "consumed_valid_samples": train_state.consumed_valid_samples,
    }
    return argparse.Namespace(**args)


def chained_parts(named_parameters) -> list[set[float]] | None:
    """A MoE model's two optimizers in Megatron-LM (megatron-core's ``get_megatron_optimizer``: the
    dense parameters', then the experts'), as the weight-decay multipliers of the param groups each
    holds (its loader matches saved groups to them one for one); None without experts. Read from the
    saving rank's stage (rank 0): a pipeline stage without MoE layers has one optimizer in
    Megatron-LM, whose load of this chained state then fails, as it does for its own checkpoints."""
    parts: list[set[float]] = [set(), set()]
    for name, param in named_parameters:
        parts[".experts." in name].add(1.0 if param.ndim >= 2 else 0.0)
    return parts if parts[1] else None


def megatron_lm_optimizer(
    common: dict, max_lr: float, min_lr: float | None, fp32_weights: bool, parts: list | None = None
) -> dict:
    """Our optimizer common state (``common_state``) with megatron-core's form of it added: param
    groups carrying the keys it matches groups by (0.16's four; since 2026-07 also ``max_lr`` and
    ``min_lr``, which its groups always hold) and FusedAdam's per-group ``step`` and
    ``bias_correction``, and the step as ``state.common_step`` (torch's Adam; at the top level for
    ``FP32Optimizer``, under ``optimizer`` for mixed precision, where the fp32 main weights are saved).
    With the distributed optimizer, ``DistributedOptimizer``'s form; ``fp32_weights`` (the model's
    weights are fp32, so Megatron-LM's ``FP32Optimizer`` may resume it too) adds the groups flat.
    ``parts`` (``chained_parts``): a MoE model's, which Megatron-LM steps with a chained optimizer:
    one such state per part, keyed 0, 1, each with the groups of its part (the experts'
    ``is_expert_parallel``); ``unchained`` gives ours back."""
    if parts:
        return {
            i: _megatron_lm_form(common, max_lr, min_lr, fp32_weights, i, wd) for i, wd in enumerate(parts)
        }
    return _megatron_lm_form(common, max_lr, min_lr, fp32_weights, False, None)


def _megatron_lm_form(common, max_lr, min_lr, fp32_weights: bool, expert: bool, wd_mults: set | None):
    fused = {"step": int(common["step"]), "bias_correction": True}
    identifiers = {**_IDENTIFIERS, "is_expert_parallel": bool(expert), "max_lr": max_lr, "min_lr": min_lr}
    mine = [g for g in common["param_groups"] if wd_mults is None or g["wd_mult"] in wd_mults]
    groups = [{**identifiers, **fused, **g} for g in mine]
    theirs = {"param_groups": groups, "state": {"common_step": torch.tensor(float(common["step"]))}}
    if not common.get("use_distributed_optimizer"):
        return {**common, "optimizer": theirs} if common.get("fp32_param") else {**common, **theirs}
    # megatron-core's DistributedOptimizer reads its groups (the step in each) under ``optimizer``,
    # its tensors in its fully reshardable layout; FP32Optimizer, for a resume without it, the groups flat.
    distributed = {"optimizer": theirs, "param_state_sharding_type": "fully_reshardable"}
    return {**common, **(theirs if fp32_weights else {}), **distributed}


def unchained(optimizer: dict) -> dict:
    """Our optimizer common state from ``megatron_lm_optimizer``'s: a chained one's first part with
    every part's param groups (each part holds only its own)."""
    if 0 not in optimizer:
        return optimizer
    parts = [optimizer[k] for k in sorted(k for k in optimizer if isinstance(k, int))]
    return {**parts[0], "param_groups": [g for part in parts for g in part["param_groups"]]}


def content_metadata(distributed: bool) -> dict:
    """Megatron-LM's content metadata (``_build_sharded_state_dict_metadata``), which lays out its
    load's request: the layout our tensors have (model space, no chained-optimizer prefix)."""
    metadata = {"chained_optim_avoid_prefix": True, "singleton_local_shards": False}
    if distributed:
        metadata |= {"distrib_optim_sharding_type": "fully_reshardable"}
    return metadata
