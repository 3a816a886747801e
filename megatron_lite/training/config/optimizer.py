"""The optimizer and data-parallel sections of ConfigContainer (Megatron-Bridge names) and the
checks across them and the model that upstream runs in ConfigContainer.validate.

megatron_lite's optimizer is AdamW with fp32 master weights, replicated or (use_distributed_optimizer)
sharded over data parallelism; its DDP reduces gradient buckets, optionally overlapped with backward.
The FSDP and precision-aware fields keep upstream's names and defaults so configs port, and
ConfigContainer.validate refuses them switched on.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig as _CoreOptimizerConfig
from megatron_lite.training.errors import require


@dataclass(kw_only=True)
class OptimizerConfig(_CoreOptimizerConfig):
    """The core OptimizerConfig plus upstream's training-side fields and a finalize()."""

    min_lr: float | None = None
    """Learning rate at the end of decay; None means 0.0 (Megatron-LM's default)."""
    decoupled_lr: float | None = None
    """A separate learning rate for the input and output embeddings (not supported yet: None)."""
    use_distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam state over data-parallel ranks (ZeRO-1)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's parameter all-gather with the next forward."""
    use_precision_aware_optimizer: bool = False
    """Keep optimizer state in lower precision (not supported yet: False)."""

    def finalize(self) -> None:
        if self.min_lr is None:
            self.min_lr = 0.0


@dataclass(kw_only=True)
class DistributedDataParallelConfig:
    """How gradients are reduced over the data-parallel group."""

    grad_reduce_in_fp32: bool = False
    """Reduce gradients in fp32 (megatron_lite keeps fp32 main gradients, so they always are)."""
    overlap_grad_reduce: bool = False
    """Start each bucket's reduction from the backward pass as soon as its gradients are final."""
    overlap_param_gather: bool = False
    """Overlap the parameter all-gather (distributed optimizer only)."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients into per-rank shards for the distributed optimizer."""
    check_for_nan_in_grad: bool = False
    """Check gradients for NaN before reducing them."""
    bucket_size: int | None = None
    """Parameters per bucket (with overlap_grad_reduce); None means upstream's max(4e7, 1e6 * dp)."""
    average_in_collective: bool = False
    """Average inside the collective instead of scaling before it."""
    use_megatron_fsdp: bool = False
    """Megatron FSDP (not supported: False)."""
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """MXFP8 parameter all-gather buffer reuse (FP8 is not supported: False)."""

    def finalize(self) -> None:
        """Nothing is derived yet; present so ConfigContainer.validate finalizes every section alike."""


def _validate_and_sync_distributed_optimizer_settings(config) -> None:
    """As upstream: switching the distributed optimizer (or param-gather overlap) on in either the
    DDP or the optimizer section switches it on in both, with a warning on rank 0."""
    # warn_rank_0 is looked up on the package when called: upstream's tests patch it there.
    warn = sys.modules[__package__].warn_rank_0
    for name, label, what in (
        ("use_distributed_optimizer", "Distributed optimizer", "distributed optimizer"),
        ("overlap_param_gather", "overlap_param_gather", "overlap_param_gather"),
    ):
        ddp_value, opt_value = getattr(config.ddp, name), getattr(config.optimizer, name)
        if ddp_value or opt_value:
            if ddp_value != opt_value:
                warn(
                    f"{label} settings were not in sync: ddp.{name}={ddp_value}, optimizer.{name}={opt_value}. "
                    f"Automatically enabling {what} for both settings."
                )
            setattr(config.ddp, name, True)
            setattr(config.optimizer, name, True)


def _validate_mixed_precision_consistency(config) -> None:
    """bf16 and fp16 are exclusive, and a precision-aware optimizer must match the model's precision."""
    m, o = config.model, config.optimizer
    require(
        not (m.bf16 and m.fp16),
        "--bf16",
        "Model config cannot have both bf16=True and fp16=True. Please set only one precision mode.",
    )
    require(
        not (o.bf16 and o.fp16),
        "--bf16",
        "Optimizer config cannot have both bf16=True and fp16=True. Please set only one precision mode.",
    )
    if not o.use_precision_aware_optimizer:
        return
    if m.bf16:
        require(
            o.bf16,
            "--bf16",
            "optimizer.bf16=True must be set when model.bf16=True and use_precision_aware_optimizer=True.",
        )
    if m.fp16:
        require(
            o.fp16,
            "--fp16",
            "optimizer.fp16=True must be set when model.fp16=True and use_precision_aware_optimizer=True.",
        )
    if not m.bf16 and not m.fp16:
        require(
            not o.bf16 and not o.fp16,
            "--bf16",
            "optimizer.bf16 and optimizer.fp16 must both be False when model is using fp32 precision "
            "(model.bf16=False, model.fp16=False) and use_precision_aware_optimizer=True.",
        )
