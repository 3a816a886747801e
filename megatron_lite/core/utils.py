"""Initialisation helpers and small utilities, as in megatron.core.utils (whose names are all here:
the process-group ones live in core/process_group_utils.py, below the tensor-parallel layers, and the
deferred output-layer GEMMs' drain with those GEMMs)."""

from __future__ import annotations

import functools
import math
import zlib
from contextlib import contextmanager

import torch

from megatron_lite.core import parallel_state
from megatron_lite.core.packed_seq_params import PackedSeqParams, thd_partitioned_indices
from megatron_lite.core.process_group_utils import (  # noqa: F401 (upstream's names here)
    collective_backend,
    fake_world_backend,
    fake_world_stands_for,
    get_collective_device,
    get_pg_rank,
    get_pg_size,
    get_tensor_model_parallel_group_if_none,
    kernel_device_type,
)
from megatron_lite.core.tensor_parallel.linear_wgrad import drain_embedding_wgrad_compute  # noqa: F401


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


def _is_thd_metadata(key: str) -> bool:
    """Keys of a packed batch that stay whole under CP: the global boundaries and the mask."""
    return key.startswith(("cu_seqlens", "max_seqlen")) or key == "attention_mask"


def get_thd_batch_on_this_cp_rank(
    batch: dict,
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: torch.Tensor | None,
    max_seqlen,
    cp_size: int | None = None,
    cp_rank: int | None = None,
):
    """A packed batch (one row) sliced to this CP rank: chunks ``r`` and ``2 cp - 1 - r`` of every
    example (each padded to a multiple of ``2 cp``), megatron-core's signature. Every [b, s, ...]
    tensor is sliced; the boundaries (``cu_seqlens*``, ``max_seqlen*``) stay whole, being global.
    Returns the batch and its ``PackedSeqParams``."""
    max_seqlen = int(max_seqlen.reshape(-1)[0]) if torch.is_tensor(max_seqlen) else int(max_seqlen)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_kv=cu_seqlens,
        cu_seqlens_q_padded=cu_seqlens_padded,
        cu_seqlens_kv_padded=cu_seqlens_padded,
        max_seqlen_q=max_seqlen,
        max_seqlen_kv=max_seqlen,
    )
    cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
    if cp_size > 1:
        layout = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        sequences = [
            k for k, v in batch.items() if not _is_thd_metadata(k) and torch.is_tensor(v) and v.dim() > 1
        ]
        total = batch[sequences[0]].size(1)
        index = thd_partitioned_indices(layout, total, cp_size, cp_rank)
        batch = {
            k: v.index_select(1, index.to(v.device)) if k in sequences and v.size(1) == total else v
            for k, v in batch.items()
        }
    return batch, params


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


def is_torch_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether the installed torch is at least ``version`` (strictly newer without
    ``check_equality``); ``torch.__version__`` compares with a version string itself. Upstream's name,
    which its unit tests call at import."""
    return torch.__version__ >= version if check_equality else torch.__version__ > version


def get_te_version():
    """Transformer Engine's version, ``0.0.0`` where it is not installed (as upstream reports it): this
    framework does not use TE, so upstream's "TE at least X" branches read as false here."""
    from importlib.metadata import PackageNotFoundError, version

    from torch.torch_version import TorchVersion

    try:
        return TorchVersion(version("transformer-engine"))
    except PackageNotFoundError:
        return TorchVersion("0.0.0")


def is_te_min_version(version: str, check_equality: bool = True) -> bool:
    """Whether Transformer Engine is installed at ``version`` or later (strictly later without
    ``check_equality``); upstream's name, which its unit tests call at import."""
    return get_te_version() >= version if check_equality else get_te_version() > version
