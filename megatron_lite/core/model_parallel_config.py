"""ModelParallelConfig: the parallel layout and numerics every parallel module reads, as in
megatron.core.model_parallel_config. TransformerConfig extends it with the model's shape."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class _PrecisionDtype:
    """A dtype field that, left unset (None), follows the precision flags: ``params_dtype`` is bf16
    under ``bf16`` and fp32 otherwise; ``pipeline_dtype`` is ``params_dtype``. Derived at read time
    so that flipping ``bf16`` after construction (CLI overrides do) still takes effect."""

    def __init__(self, fallback: str | None = None):
        self.fallback = fallback

    def __set_name__(self, owner, name: str) -> None:
        self.slot = f"_{name}_explicit"

    def __get__(self, obj, objtype=None):
        if obj is None:
            return None  # the dataclass default
        explicit = obj.__dict__.get(self.slot)
        if explicit is not None:
            return explicit
        if self.fallback is not None:
            return getattr(obj, self.fallback)
        return torch.bfloat16 if obj.bf16 else torch.float32

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclass(kw_only=True)
class ModelParallelConfig:
    """Parallel sizes, initialisation and precision shared by the parallel layers and schedules.

    Features megatron_lite does not have yet (virtual pipeline stages, expert
    parallelism) keep upstream's field so configs port, and are refused where a run is set up.
    """

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Interleaved pipeline chunks per stage (not supported yet: None or 1)."""
    pipeline_model_parallel_comm_backend: str | None = None
    """Backend of the pipeline group; None means the default backend."""
    context_parallel_size: int = 1
    """Context-parallel size."""
    sequence_parallel: bool = False
    """Split norms, dropout and residuals along the sequence over the tensor-parallel ranks (tp > 1)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size (MoE is not supported: 1)."""
    expert_tensor_parallel_size: int | None = None
    """Expert tensor-parallel size; None means tensor_model_parallel_size."""

    perform_initialization: bool = True
    """Draw initial weights; False leaves them uninitialised (e.g. about to load a checkpoint)."""
    use_cpu_initialization: bool = False
    """Allocate parameters on the CPU. Initial values are the same either way in megatron_lite:
    every layer draws its full master weight and keeps its slice, so any layout starts identical."""

    fp16: bool = False
    """fp16 compute (not supported yet)."""
    bf16: bool = False
    """bf16 compute with fp32 master weights."""
    params_dtype: torch.dtype | None = _PrecisionDtype()
    """dtype of the parameters; None follows ``bf16`` (bf16, else fp32)."""
    pipeline_dtype: torch.dtype | None = _PrecisionDtype("params_dtype")
    """dtype of activations sent between pipeline stages; None means ``params_dtype``."""
    variable_seq_lengths: bool = False
    """Sequence length varies between micro-batches (shapes are then exchanged before each send)."""
    deallocate_pipeline_outputs: bool = False
    """Free a stage's output data once it was sent, keeping only its autograd graph."""
    deterministic_mode: bool = False
    """Prefer deterministic kernels."""
    gradient_accumulation_fusion: bool = False
    """Fused weight-gradient accumulation (a CUDA extension; not supported: False)."""
    async_tensor_model_parallel_allreduce: bool = False
    """Overlap the input-gradient all-reduce with the weight-gradient GEMM (not supported: False)."""
    cross_entropy_loss_fusion: bool = False
    """Fused cross entropy (not supported: False)."""
    tp_comm_overlap: bool = False
    """Userbuffer TP communication overlap (not supported: False)."""
    batch_p2p_comm: bool = True
    """Batch pipeline sends and receives into one call."""
    overlap_p2p_comm: bool = False
    """Overlap pipeline communication with compute (interleaved schedule only)."""

    # Hooks the training loop installs on the config; plain class attributes, not fields, so that
    # copying or serialising a config (checkpoints store ``asdict``) never touches process groups.
    timers = None
    finalize_model_grads_func = None
    grad_scale_func = None
    no_sync_func = None
    grad_sync_func = None
    param_sync_func = None
