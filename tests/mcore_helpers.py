"""What the tests that interchange checkpoints with megatron-core (the dev extra's oracle) share: its
CPU runs with a few CUDA calls replaced (each named where it is replaced), seeded and poisoned
parameters, and bitwise comparisons of state dicts."""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_lite.training.checkpointing.torch_dist import SHARDED_BACKEND

# A small Llama-shaped model both sides build (megatron-core's TransformerConfig and our provider):
# 2 query heads per key/value group, no biases, no dropout.
SMALL_LLAMA = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=4,
    kv_channels=8,
    ffn_hidden_size=96,
    normalization="RMSNorm",
    layernorm_epsilon=1e-6,
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def randomize(model, is_split, rank: int) -> None:
    """Random values in every parameter (norms too, not their ones), seeded by name and, for a tensor
    split over ranks (``is_split(name, param)``), by ``rank``: a replicated tensor is the same on every
    rank, as in training."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            seed = zlib.crc32(name.encode()) + (1000 * rank if is_split(name, param) else 0)
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))


def poison(model) -> None:
    """NaN everywhere, so a tensor the load does not reach fails the comparison."""
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))


def tensors(model) -> dict[str, torch.Tensor]:
    """The state dict without megatron-core's ``_extra_state`` entries: its local layers keep them
    (None) only for Transformer Engine compatibility; ours have none."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def assert_same(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys(), sorted(ours.keys() ^ theirs.keys())
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and value.shape == theirs[key].shape, key
        assert torch.equal(value, theirs[key]), key


def mcore_save_on_cpu():
    """The two CUDA calls of megatron-core's save on the CPU: ``torch.cuda.synchronize()`` after
    copying the tensors to host memory (strategies/filesystem_async.py,
    FileSystemWriterAsync.preload_tensors, unconditionally) and ``torch.cuda.current_device()`` as the
    device of an all-reduce (strategies/state_dict_saver.py, save_state_dict_async_finalize), which
    gloo does on the CPU. unittest.mock, not pytest-mock's ``mocker``: this runs in a rank forked by
    run_world, where pytest's fixtures are not."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch("torch.cuda.synchronize", lambda *args, **kwargs: None))
    stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
    return stack


def mcore_forward_on_cpu():
    """megatron-core's forward on the CPU: its RoPE moves the frequencies to
    ``torch.cuda.current_device()`` on the first call (rotary_pos_embedding.py,
    RotaryEmbedding.get_emb), here "cpu"; its attention forks the CUDA RNG tracker for dropout
    (dot_product_attention.py, DotProductAttention.forward), which needs CUDA generators: the dropout
    is 0, so a fork that keeps the current generator changes nothing; its MoE router reads
    ``te_general_gemm``, a name bound only when Transformer Engine is installed
    (moe/moe_utils.py, RouterGatingLinearFunction.forward), here None: torch's matmul. (Its default
    causal mask is built on "cuda" too, so callers pass their own.)"""
    no_fork = mock.Mock(fork=contextlib.nullcontext)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(mock.patch("torch.cuda.current_device", lambda: "cpu"))
    stack.enter_context(mock.patch("megatron.core.tensor_parallel.get_cuda_rng_tracker", lambda: no_fork))
    stack.enter_context(
        mock.patch("megatron.core.transformer.moe.moe_utils.te_general_gemm", None, create=True)
    )
    return stack


def causal_mask(seq: int) -> torch.Tensor:
    """megatron-core's attention mask (True: masked out)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]


def write_backend_files(root: str) -> None:
    """What save_distributed adds to the DCP files: megatron-core's metadata.json, which its load
    reads the strategies from, and a common.pt, which it loads first and merges the tensors into (any
    dict; save_distributed's holds the iteration, config, RNG states ...). Rank 0 writes; collective."""
    if dist.get_rank() == 0:
        with open(os.path.join(root, "metadata.json"), "w") as f:
            json.dump(SHARDED_BACKEND, f)
        torch.save({"iteration": 0}, os.path.join(root, "common.pt"))
    dist.barrier()
