"""The vocab-parallel cross entropy allocates what megatron-core's does (issue 45): measured by PyTorch's
own allocator events (torch.profiler) on the same logits, megatron-core's function (the dev extra) as
the oracle, with a stand-in tensor-parallel group of one rank as upstream's own test uses."""

from __future__ import annotations

import pytest
import torch
from megatron.core.tensor_parallel import cross_entropy as mcore_cross_entropy
from memory_measure import profiler_peak_and_final

from megatron_lite.core.tensor_parallel import cross_entropy

TOKENS, VOCAB = 512, 4096


class _OneRank:
    def rank(self):
        return 0

    def size(self):
        return 1


def _peak_above_start(fn) -> int:
    """The most bytes the CPU allocator held at once during ``fn()`` beyond what it held before."""
    return profiler_peak_and_final(fn)[0]


def _forward_and_backward(loss_fn, dtype: torch.dtype):
    def run():
        torch.manual_seed(0)
        logits = torch.randn(TOKENS, VOCAB, dtype=dtype, requires_grad=True)
        target = torch.randint(0, VOCAB, (TOKENS,))
        loss_fn(logits, target).sum().backward()

    return run


def _megatron_core(mocker):
    """megatron-core 0.16's function, which reads its group from parallel_state: one rank here."""
    for name, value in (("group", _OneRank()), ("rank", 0), ("world_size", 1)):
        mocker.patch.object(mcore_cross_entropy, f"get_tensor_model_parallel_{name}", return_value=value)
    return mcore_cross_entropy.vocab_parallel_cross_entropy


def _ours(logits, target):
    return cross_entropy.vocab_parallel_cross_entropy(logits, target, tp_group=_OneRank())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_peak_is_megatron_cores(mocker, dtype):
    mocker.patch("torch.distributed.all_reduce")  # one rank: nothing to reduce
    ours = _peak_above_start(_forward_and_backward(_ours, dtype))
    theirs = _peak_above_start(_forward_and_backward(_megatron_core(mocker), dtype))
    fp32_logits = TOKENS * VOCAB * 4
    # The same op-by-op allocation up to token-sized vectors (masks, targets, the loss).
    assert abs(ours - theirs) <= 64 * TOKENS, (ours, theirs)
    # And what that is: the logits, their gradient and at most one fp32 working copy beside them
    # (in place from the upcast on; fp32 logits are that copy themselves), never two.
    logits = TOKENS * VOCAB * torch.tensor([], dtype=dtype).element_size()
    extra = fp32_logits if dtype != torch.float32 else 0
    assert ours <= 2 * logits + extra + 64 * TOKENS, (ours, logits)


def test_fp32_logits_become_the_softmax_in_place_as_upstream(mocker):
    mocker.patch("torch.distributed.all_reduce")
    logits = torch.randn(8, 16)
    softmax = torch.softmax(logits, -1)
    _ours(logits, torch.randint(0, 16, (8,)))
    assert torch.allclose(logits, softmax)
