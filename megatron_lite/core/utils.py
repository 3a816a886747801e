"""Initialisation helpers and small utilities, as in megatron.core.utils."""

from __future__ import annotations

import functools
import math
import zlib
from contextlib import contextmanager

import torch
import torch.distributed as dist


def _normal_init(tensor: torch.Tensor, sigma: float) -> torch.Tensor:
    return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)


def init_method_normal(sigma: float):
    """Normal(0, sigma) initialisation. A partial of a module-level function, not a closure, so a
    config holding it (TransformerConfig.init_method) still pickles into checkpoints."""
    return functools.partial(_normal_init, sigma=sigma)


def scaled_init_method_normal(sigma: float, num_layers: int):
    """Normal(0, sigma / sqrt(2 num_layers)): Megatron's init for output projections feeding a residual."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


@contextmanager
def seeded_init(seed: int, key: str):
    """Draw initial weights from an RNG keyed by ``(seed, key)`` and restore the global RNG after.

    Keys name model parts by their global position (``layer 5``, ``embedding``), so a part gets the same
    weights on whichever pipeline stage it lives.
    """
    state = torch.random.get_rng_state()
    torch.manual_seed(zlib.crc32(f"{seed}/{key}".encode()))
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


# The backend the preflight's dry run has its fake world (torch.distributed's "fake" backend) stand
# for, in the code paths that differ by backend; None outside a dry run.
_FAKE_WORLD_STANDS_FOR: str | None = None


@contextmanager
def fake_world_stands_for(backend: str):
    """Within: a collective over a fake process group takes ``backend``'s code path ("nccl" for a GPU
    job, "gloo" for a CPU one); see :func:`collective_backend`."""
    global _FAKE_WORLD_STANDS_FOR
    before, _FAKE_WORLD_STANDS_FOR = _FAKE_WORLD_STANDS_FOR, backend
    try:
        yield
    finally:
        _FAKE_WORLD_STANDS_FOR = before


def fake_world_backend() -> str | None:
    """The backend the preflight's dry run has its fake world stand for; None outside a dry run."""
    return _FAKE_WORLD_STANDS_FOR


def kernel_device_type(tensor: torch.Tensor) -> str:
    """Whose kernels (and budgets) ``tensor``'s ops take: its device's, or CUDA's in the preflight's dry
    run of a GPU job, whose fake tensors live on the CPU."""
    return "cuda" if _FAKE_WORLD_STANDS_FOR == "nccl" else tensor.device.type


def collective_backend(group=None) -> str:
    """The backend whose code path a collective over ``group`` takes: the group's own, or for a fake
    process group the one the preflight's dry run has it stand for."""
    backend = str(dist.get_backend(group)).lower()
    return (_FAKE_WORLD_STANDS_FOR or backend) if backend == "fake" else backend


def get_collective_device(group=None) -> torch.device:
    """The device a tensor must live on for a collective over ``group``: the current CUDA device for
    NCCL, the CPU otherwise (gloo, or an object that is no process group, such as a test stand-in)."""
    try:
        backend = torch.distributed.get_backend(group)
    except Exception:
        return torch.device("cpu")
    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cp_positions(seq_length: int, cp_rank: int, cp_size: int, device=None) -> torch.Tensor:
    """Sequence positions CP rank ``cp_rank`` holds: chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``, so
    every rank gets an equal share of causal-attention work (Megatron's load-balanced split)."""
    chunk = seq_length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device)
    return torch.cat([first, second])


def get_batch_on_this_cp_rank(batch: dict[str, torch.Tensor], cp_rank: int, cp_size: int) -> dict:
    """Slice every [b, s] tensor of ``batch`` to this CP rank's positions (see ``cp_positions``)."""
    if cp_size == 1:
        return batch
    out = {}
    for key, value in batch.items():
        index = cp_positions(value.size(1), cp_rank, cp_size, device=value.device)
        out[key] = value.index_select(1, index)
    return out


def get_model_config(model: torch.nn.Module):
    """The TransformerConfig of a (possibly wrapped) model."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model.config


def get_attr_wrapped_model(model, attr: str, allow_none: bool = True, return_model_obj: bool = False):
    """``attr`` of the first of model, model.module, ... that has it (that is not None unless
    ``allow_none``), or that object itself with ``return_model_obj``."""
    if isinstance(model, list):
        raise RuntimeError("_get_attr_wrapped_model given a list of models")

    def missing(m) -> bool:
        return not hasattr(m, attr) if allow_none else getattr(m, attr, None) is None

    while missing(model):
        if not hasattr(model, "module"):
            raise RuntimeError(f"_get_attr_wrapped_model couldn't find attribute {attr}")
        model = model.module
    return model if return_model_obj else getattr(model, attr)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def get_tensor_model_parallel_group_if_none(
    tp_group, is_expert: bool = False, check_initialized: bool = True
):
    """``tp_group``, or parallel_state's tensor-parallel group when it is None and the groups exist.

    Outside torch.distributed this is None; before ``initialize_model_parallel`` ``tp_group`` passes
    through unchanged, so a None group then means "no tensor parallelism" (upstream's behaviour).
    """
    from megatron_lite.core import parallel_state

    if not dist.is_initialized():
        return None
    if not parallel_state.is_initialized() or tp_group is not None:
        return tp_group
    if is_expert:
        return parallel_state.get_expert_tensor_parallel_group(check_initialized=check_initialized)
    return parallel_state.get_tensor_model_parallel_group(check_initialized=check_initialized)


def get_pg_size(group=None) -> int:
    """Size of ``group``; 1 when there is no group (no tensor parallelism, or no distributed run)."""
    return 1 if group is None else group.size()


def get_pg_rank(group=None) -> int:
    """This process's rank in ``group``; 0 when there is no group."""
    return 0 if group is None else group.rank()


def __getattr__(name: str):
    # Upstream's path to the deferred output-layer GEMMs' drain, which lives with those GEMMs
    # (tensor_parallel.linear_wgrad imports this module, so it cannot be imported here up front).
    if name == "drain_embedding_wgrad_compute":
        from megatron_lite.core.tensor_parallel.linear_wgrad import drain_embedding_wgrad_compute

        return drain_embedding_wgrad_compute
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
