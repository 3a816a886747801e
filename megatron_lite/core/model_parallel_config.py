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

    Features megatron_lite does not have keep upstream's field so configs port, and are refused where
    a run is set up.
    """

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline_model_parallel_size: int | None = None
    """Model chunks per pipeline rank (interleaved 1F1B when > 1); None means one."""
    microbatch_group_size_per_vp_stage: int | None = None
    """Consecutive microbatches the interleaved schedule runs through each chunk; None means pp."""
    pipeline_model_parallel_comm_backend: str | None = None
    """Backend of the pipeline group; None means the default backend."""
    context_parallel_size: int = 1
    """Context-parallel size."""
    sequence_parallel: bool = False
    """Split norms, dropout and residuals along the sequence over the tensor-parallel ranks (tp > 1)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size: the routed experts of each MoE layer are split over this many ranks."""
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
    defer_embedding_wgrad_compute: bool = False
    """Defer the output layer's weight-gradient GEMMs of the last pipeline stage to the pipeline flush,
    where they fill the wait for the other stages' backwards; each deferred microbatch keeps the
    layer's input and output gradient until then. Needs pipeline parallelism (upstream also needs
    gradient_accumulation_fusion; megatron_lite adds the deferred GEMMs into main_grad without it)."""
    wgrad_deferral_limit: int = 0
    """Microbatches per step whose output-layer weight gradient is deferred (the first ones); 0 means
    all. Ignored unless defer_embedding_wgrad_compute."""
    deterministic_mode: bool = False
    """Prefer deterministic kernels."""
    gradient_accumulation_fusion: bool = False
    """Dense linear layers (not the routed experts' grouped GEMM) add their weight gradient straight into the parameter's fp32 ``main_grad`` (DDP's),
    so no weight-sized gradient exists (core/fusions/fused_weight_gradient: an fp32-output GEMM on CUDA,
    slices of tokens upcast elsewhere). Megatron-LM turns it on by default (``--no-gradient-accumulation-fusion``)."""
    async_tensor_model_parallel_allreduce: bool = False
    """Overlap the input-gradient all-reduce with the weight-gradient GEMM (not supported: False)."""
    cross_entropy_loss_fusion: bool = False
    """The output layer and the vocab-parallel cross entropy computed together over chunks of tokens
    (core/fusions/fused_linear_cross_entropy.py): no [s, b, vocab / tp] logits at any instant."""
    cross_entropy_fusion_impl: str = "native"
    """``native`` (megatron_lite's chunked fusion); ``te`` (Transformer Engine's kernel) is refused."""
    cross_entropy_fusion_chunk_tokens: int | None = None
    """Tokens per chunk of the fused loss; None: the device's default (its fp32 logits near 64 MiB on
    CUDA, 32 MiB on the CPU). megatron_lite's."""
    tp_comm_overlap: bool = False
    """Userbuffer TP communication overlap (not supported: False)."""
    batch_p2p_comm: bool = True
    """Batch pipeline sends and receives into one call."""
    overlap_p2p_comm: bool = False
    """Overlap pipeline communication with compute (interleaved schedule only)."""

    def __post_init__(self) -> None:
        if self.defer_embedding_wgrad_compute and self.pipeline_model_parallel_size == 1:
            raise ValueError("Cannot defer embedding wgrad compute when pipeline model parallel is not used")
        if self.defer_embedding_wgrad_compute and self.wgrad_deferral_limit < 0:
            raise ValueError("Wgrad deferral limit should be greater than or equal to 0 when it is enabled!")

    # Hooks the training loop installs on the config; plain class attributes, not fields, so that
    # copying or serialising a config (checkpoints store ``asdict``) never touches process groups.
    timers = None
    finalize_model_grads_func = None
    grad_scale_func = None
    no_sync_func = None
    grad_sync_func = None
    param_sync_func = None
