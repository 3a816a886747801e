"""The parallel layout's checks, run by validate with the other config checks: layers, heads, the
MLP, the expert grid and the batch split evenly over the layout, interleaving has microbatches for
every chunk, and --defer-embedding-wgrad-compute has a flush to wait for. Each failure is one
ConfigError naming the flag and the fix."""

from __future__ import annotations

import math

from megatron_lite.core.pipeline_parallel.schedule_order import check_interleaving
from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.training.errors import ConfigError


def check_divisibility(cfg) -> None:
    m, t = cfg.model, cfg.train
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    if m.virtual_pipeline_model_parallel_size is not None and m.virtual_pipeline_model_parallel_size < 1:
        raise ConfigError(
            "--virtual-pipeline-model-parallel-size",
            f"must be a positive integer, got {m.virtual_pipeline_model_parallel_size}",
        )
    vp = m.virtual_pipeline_model_parallel_size or 1
    _check_layer_split(m, pp, vp)
    if m.num_attention_heads % tp:
        raise ConfigError(
            "--num-attention-heads",
            f"{m.num_attention_heads} heads do not split over --tensor-model-parallel-size {tp}; "
            f"use a multiple of {tp}",
        )
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            "--hidden-size",
            f"{m.hidden_size} is not divisible by --num-attention-heads {m.num_attention_heads}",
        )
    if m.ffn_hidden_size % tp:
        raise ConfigError(
            "--ffn-hidden-size", f"{m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}"
        )
    if vp > 1:
        _check_interleaving(cfg, pp)
    _check_expert_grid(cfg)
    per_step = t.micro_batch_size * cfg.data_parallel_size
    if t.global_batch_size % per_step:
        raise ConfigError(
            "--global-batch-size",
            f"{t.global_batch_size} is not divisible by --micro-batch-size x data-parallel size = "
            f"{t.micro_batch_size} x {cfg.data_parallel_size}",
        )


def _check_expert_grid(cfg) -> None:
    """parallel_state.initialize_model_parallel's expert grid, expert TP x EP x expert DP x PP, must
    cover the same world: each stage's tp x cp x dp ranks split into groups of etp x ep (the expert
    ranks come out of the data-parallel ones, as upstream; the world size stays tp x pp x cp x dp)."""
    m = cfg.model
    tp, cp, pp = m.tensor_model_parallel_size, m.context_parallel_size, m.pipeline_model_parallel_size
    etp, ep = m.expert_tensor_parallel_size or tp, m.expert_model_parallel_size
    per_stage = tp * cp * cfg.data_parallel_size
    if per_stage % (etp * ep):
        flag = "--expert-model-parallel-size" if ep > 1 else "--expert-tensor-parallel-size"
        raise ConfigError(
            flag,
            f"tp x cp x dp = {per_stage} ranks per pipeline stage do not split into expert groups of "
            f"etp x ep = {etp} x {ep}; use a world size (--nproc-per-node) that is a multiple of "
            f"{pp * math.lcm(tp * cp, etp * ep)}",
        )


def _check_layer_split(m, pp: int, vp: int) -> None:
    """The layers split over stages and their chunks by Megatron's rules (pipeline_layer_split)."""
    first, last = m.num_layers_in_first_pipeline_stage, m.num_layers_in_last_pipeline_stage
    if m.pipeline_model_parallel_layout is not None:
        flag = "--pipeline-model-parallel-layout"
    elif first is not None or last is not None:
        flag = (
            "--decoder-first-pipeline-num-layers"
            if first is not None
            else "--decoder-last-pipeline-num-layers"
        )
    elif m.account_for_embedding_in_pipeline_split or m.account_for_loss_in_pipeline_split:
        embedding = m.account_for_embedding_in_pipeline_split
        flag = (
            "--account-for-embedding-in-pipeline-split"
            if embedding
            else "--account-for-loss-in-pipeline-split"
        )
    elif m.num_layers % pp:
        raise ConfigError(
            "--num-layers",
            f"{m.num_layers} layers do not split evenly over --pipeline-model-parallel-size {pp}; "
            f"use a multiple of {pp}",
        )
    elif m.num_layers % (pp * vp):
        raise ConfigError(
            "--virtual-pipeline-model-parallel-size",
            f"{vp} chunks on each of {pp} stages do not split {m.num_layers} layers evenly; use a multiple of {pp * vp}",
        )
    else:
        return
    try:
        pipeline_layer_counts(m)
    except ValueError as err:
        raise ConfigError(flag, str(err)) from None


def _check_interleaving(cfg, pp: int) -> None:
    m = cfg.model
    if pp == 1:
        raise ConfigError(
            "--virtual-pipeline-model-parallel-size", "needs --pipeline-model-parallel-size > 1"
        )
    group = m.microbatch_group_size_per_vp_stage or pp
    microbatches = cfg.train.global_batch_size // (cfg.train.micro_batch_size * cfg.data_parallel_size)
    try:
        check_interleaving(microbatches, pp, group)
    except ValueError as err:
        raise ConfigError("--global-batch-size", f"interleaved 1F1B: {err}") from None


def check_deferred_wgrad(cfg) -> None:
    """--defer-embedding-wgrad-compute runs the output layer's weight-gradient GEMMs at the pipeline
    flush, after the last backward: there must be a flush, and no reduction may start before them."""
    m, flag = cfg.model, "--defer-embedding-wgrad-compute"
    if not m.defer_embedding_wgrad_compute:
        return
    if m.pipeline_model_parallel_size == 1:
        raise ConfigError(
            flag, "needs --pipeline-model-parallel-size > 1 (the GEMMs wait for the pipeline flush)"
        )
    if m.wgrad_deferral_limit < 0:
        raise ConfigError(
            "--wgrad-deferral-limit",
            f"must be >= 0 (0 defers every microbatch), got {m.wgrad_deferral_limit}",
        )
    if cfg.ddp.overlap_grad_reduce:
        raise ConfigError(
            flag,
            "cannot be combined with --overlap-grad-reduce: the output layer's gradient bucket would be "
            "reduced before its deferred GEMMs ran",
        )
