"""Process start-up: the default process group, model-parallel groups and seeds."""

from __future__ import annotations

import os
import random
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.memory.host_allocator import keep_freed_host_memory


def initialize_distributed(config: ConfigContainer) -> None:
    """Join the world described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).

    gloo without CUDA; nccl with one GPU per local rank otherwise.
    """
    if dist.is_initialized():
        return  # joined already (a caller's world, the preflight's fake one): as upstream, left as it is
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    backend = config.dist.distributed_backend or parallel_state.default_backend(local_world_size)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(
        backend=backend,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(minutes=config.dist.distributed_timeout_minutes),
    )


def set_random_seeds(seed: int) -> None:
    """Seed Python, NumPy and torch. Weights are drawn per model part (core.utils.seeded_init) and the
    synthetic data is indexed by sample, so only dropout depends on these seeds."""
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)  # NumPy's seeds are 32-bit; a stage adds 100 x its rank to --seed
    except ImportError:
        pass


def _set_random_seed(
    seed_: int,
    data_parallel_random_init: bool = False,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
) -> None:
    """Megatron-LM's seeding: ``seed_ + 100 x pipeline rank`` (``+ 10 x data-parallel rank`` with
    ``data_parallel_random_init``) for Python, NumPy, torch and the model-parallel streams."""
    if seed_ is None or seed_ <= 0:
        raise ValueError(f"Seed ({seed_}) should be a positive integer.")
    initialised = parallel_state.is_initialized()
    seed = seed_ + 100 * (parallel_state.get_pipeline_model_parallel_rank() if initialised else 0)
    if data_parallel_random_init and initialised:
        seed += 10 * parallel_state.get_data_parallel_rank()
    set_random_seeds(seed)
    model_parallel_cuda_manual_seed(seed, te_rng_tracker, inference_rng_tracker, use_cudagraphable_rng)


def initialize_megatron(config: ConfigContainer) -> ProcessGroupCollection:
    """Collective over the world: every rank builds every model-parallel group."""
    if not torch.cuda.is_available():
        keep_freed_host_memory()  # activations live in host memory: reuse freed blocks, don't re-fault them
    initialize_distributed(config)
    m = config.model
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size
        if (m.virtual_pipeline_model_parallel_size or 1) > 1
        else None,
        distributed_timeout_minutes=config.dist.distributed_timeout_minutes,
    )
    seed_rank_generators(config.rng.seed)
    return ProcessGroupCollection.use_mpu_process_groups()


def seed_rank_generators(seed: int) -> None:
    """This rank's generators from ``seed``. As Megatron: dropout streams differ per pipeline stage
    (and per TP rank inside the TP region)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    set_random_seeds(seed)
    model_parallel_cuda_manual_seed(seed, tp_rank=parallel_state.get_tensor_model_parallel_rank())
