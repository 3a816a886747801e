"""Which process group, rank and size a collective runs over, and which device and code path it (or a
kernel) takes, including the backend the preflight's dry run has its fake world stand for. Upstream's
names, importable from megatron_lite.core.utils as upstream's megatron.core.utils; here, below the
tensor-parallel layers that use them (core.utils itself re-exports those layers' drain)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state

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


def get_tensor_model_parallel_group_if_none(
    tp_group, is_expert: bool = False, check_initialized: bool = True
):
    """``tp_group``, or parallel_state's tensor-parallel group when it is None and the groups exist.

    Outside torch.distributed this is None; before ``initialize_model_parallel`` ``tp_group`` passes
    through unchanged, so a None group then means "no tensor parallelism" (upstream's behaviour).
    """
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
