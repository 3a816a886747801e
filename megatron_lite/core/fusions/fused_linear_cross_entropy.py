"""The output layer and the vocab-parallel cross entropy in one, over chunks of tokens
(``--cross-entropy-loss-fusion``, ``--cross-entropy-fusion-impl native``).

Unfused, the last stage materialises the logits ``[s, b, V/tp]`` (and their fp32 copy, saved as the
softmax until backward): at a 128k-256k vocabulary the largest tensors of the whole job. Here no
``[tokens, V/tp]`` tensor exists beyond one chunk of ``chunk_tokens`` rows:

- forward, per chunk: the chunk's logits (one GEMM), and per token this rank's max, the sum of the
  exponentials shifted by it and the target's logit when the target is in this rank's vocabulary
  slice: the unfused path's ops on the chunk's rows. Then, for all tokens at once, a MAX over the
  tensor-parallel group (each rank's sums rescaled to the largest max) and one SUM of the sums and
  target logits. Saved: the input, the per-token max and sum (fp32) and the targets.
- backward, per chunk: the chunk's logits again (the one GEMM more this costs), its softmax from the
  saved max and sum, minus one at the target, times the loss gradient: the chunk's logits gradient,
  cast to the weight's dtype as the unfused path's ``.float()`` backward does; then its input gradient
  (written into its rows) and its weight gradient, added straight into the weight's fp32 ``main_grad``
  as upstream's gradient-accumulation fusion does (fusions/fused_weight_gradient), so no weight-sized
  gradient exists either; a weight without one gets one weight-sized buffer.

Under sequence parallelism the layer keeps its sequence shard and each chunk gathers its rows of every
rank's shard, in each direction, and reduce-scatters its input gradient: neither the gathered sequence
nor its whole input gradient exists, only one chunk's. Without it the caller copies the input into the
tensor-parallel region (its backward all-reduces).
With ``--defer-embedding-wgrad-compute`` the weight gradient waits for the pipeline flush as the
unfused layer's does, but what waits is token-sized (each microbatch's log-sum-exps, targets and loss
gradients, beside the input the layer keeps): ``drain_wgrad`` runs the chunks again then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.fusions.fused_weight_gradient import rows_in_budget, wgrad_gemm_accum_fp32
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size, kernel_device_type
from megatron_lite.core.tensor_parallel.collectives import _gather, _reduce_scatter
from megatron_lite.core.tensor_parallel.cross_entropy import _all_reduce
from megatron_lite.core.tensor_parallel.linear_wgrad import defers_wgrad
from megatron_lite.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from megatron_lite.core.tensor_parallel.utils import VocabUtility


def default_chunk_tokens(vocab_per_rank: int, device_type: str) -> int:
    """Tokens per chunk for a device: its budget's worth of fp32 logits rows (the chunk's buffers, the
    logits, their fp32 copy and the gradient's cast, stay near it)."""
    return rows_in_budget(4 * vocab_per_rank, device_type)


def local_rows_per_chunk(chunk_tokens: int, tp: int) -> int:
    """Each rank's rows in one chunk of ``chunk_tokens`` gathered rows (under SP ``tp`` ranks
    contribute to every chunk; without it ``tp`` is 1), at least one."""
    return max(1, chunk_tokens // tp)


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss [N] (fp32) of ``input @ weight.T`` against ``target`` [N], the vocabulary split
    over ``tp_group``. Collective over ``tp_group`` in forward (and in backward under SP)."""

    @staticmethod
    def forward(
        ctx, input_, weight, target, tp_group, sequence_parallel: bool, chunk_tokens: int,
        grad_output_buffer=None, wgrad_deferral_limit: int = 0,
    ):  # fmt: skip
        chunks = _Rows(input_.reshape(-1, input_.size(-1)), tp_group, sequence_parallel, chunk_tokens)
        first, last = VocabUtility.vocab_range_from_per_partition_vocab_size(
            weight.size(0), get_pg_rank(tp_group), get_pg_size(tp_group)
        )
        target = target.reshape(-1)
        outside = (target < first) | (target >= last)
        local_target = (target - first).masked_fill(outside, 0)
        top = torch.empty(chunks.tokens, dtype=torch.float32, device=input_.device)
        total_exp = torch.empty_like(top)
        predicted = torch.empty_like(top)
        for _, x_rows, at in chunks:
            # The unfused path's ops on the chunk's rows: its GEMM, upcast, max, shift, exp and sum.
            logits = torch.mm(x_rows, weight.t()).float()
            predicted[at] = logits.gather(1, local_target[at].unsqueeze(1)).squeeze(1)
            top[at] = logits.amax(dim=-1)
            total_exp[at] = logits.sub_(top[at].unsqueeze(1)).exp_().sum(dim=-1)
            del logits, x_rows
        if get_pg_size(tp_group) > 1:  # each rank's sums rescaled to the largest max of all ranks
            local_top = top.clone()
            _all_reduce(top, dist.ReduceOp.MAX, tp_group)
            total_exp.mul_((local_top - top).exp_())
        predicted = (predicted - top).masked_fill_(outside, 0.0)
        sums = torch.stack([total_exp, predicted])
        _all_reduce(sums, dist.ReduceOp.SUM, tp_group)
        total_exp, predicted = sums[0], sums[1]
        loss = torch.log(total_exp) - predicted
        ctx.save_for_backward(input_, weight, top, total_exp, local_target, outside)
        ctx.tp_group, ctx.sequence_parallel, ctx.chunk_tokens = tp_group, sequence_parallel, chunk_tokens
        ctx.grad_output_buffer, ctx.wgrad_deferral_limit = grad_output_buffer, wgrad_deferral_limit
        # The parameter's own attribute: a saved tensor may come back as another object.
        ctx.main_grad = getattr(weight, "main_grad", None)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        input_, weight, top, total_exp, local_target, outside = ctx.saved_tensors
        group, sp, chunk = ctx.tp_group, ctx.sequence_parallel, ctx.chunk_tokens
        chunks = _Rows(input_.reshape(-1, input_.size(-1)), group, sp, chunk)
        grad_local = torch.empty_like(chunks.local)
        hit = 1.0 - outside.float()
        wants = ctx.needs_input_grad[1]
        deferred = wants and defers_wgrad(ctx.grad_output_buffer, ctx.wgrad_deferral_limit)
        # Where DDP gave the weight an fp32 main_grad, the chunks add into it (upstream's
        # gradient-accumulation fusion); else into one weight-sized gradient, returned to autograd.
        takes = wants and not deferred  # this backward computes the weight gradient
        grad_weight = torch.zeros_like(weight) if takes and ctx.main_grad is None else None
        wgrad_into = (ctx.main_grad if grad_weight is None else grad_weight) if takes else None
        stats = (top, total_exp)
        for local, x_rows, at in chunks:
            grad = _logits_grad(x_rows, weight, stats, at, local_target, hit, grad_loss)
            if chunks.tp == 1:
                torch.mm(grad, weight, out=grad_local[local])
            else:  # this rank's rows of the chunk's input gradient, summed over the group
                grad_local[local] = _reduce_scatter(torch.mm(grad, weight), group, 0)
            if wgrad_into is not None:
                wgrad_gemm_accum_fp32(x_rows, grad, wgrad_into)
            del grad, x_rows  # one chunk's buffers at a time
        if deferred:  # drain_wgrad calls it with the re-gathered input at the flush
            ctx.grad_output_buffer.append(
                _DeferredWgrad(weight, ctx.main_grad, stats, local_target, hit, grad_loss.clone(), chunk)
            )
        return grad_local.view_as(input_), grad_weight, None, None, None, None, None, None


def _logits_grad(x_rows, weight, stats, at, local_target, hit, grad_loss) -> torch.Tensor:
    """One chunk's logits gradient in the weight's dtype: the softmax from the saved max and sum (the
    unfused path's ops), less one at this rank's targets, times the loss gradient. ``at``: the chunk's
    positions in the token-sized tensors. Its fp32 buffer is freed on return when the cast makes a
    new one."""
    top, total_exp = stats
    grad = torch.mm(x_rows, weight.t()).float().sub_(top[at].unsqueeze(1)).exp_()
    grad.div_(total_exp[at].unsqueeze(1))
    grad[torch.arange(grad.size(0), device=grad.device), local_target[at]] -= hit[at]
    return grad.mul_(grad_loss[at].unsqueeze(1)).to(weight.dtype)


class _Rows:
    """The chunks of rows the loss works on, each as the (gathered) input rows and their positions in
    the token-sized tensors (the gathered sequence's order, where row ``r * n + j`` is tensor-parallel
    rank r's local row j). Under SP each chunk gathers ``chunk // tp`` local rows of every rank, so the
    gathered sequence never exists whole; its backward reduce-scatters the chunk's input gradient."""

    def __init__(self, local: torch.Tensor, group, sequence_parallel: bool, chunk_tokens: int):
        self.local, self.group = local, group
        self.tp = get_pg_size(group) if sequence_parallel else 1
        self.step = local_rows_per_chunk(chunk_tokens, self.tp)

    @property
    def tokens(self) -> int:
        return self.local.size(0) * self.tp

    def __iter__(self):
        n = self.local.size(0)
        for start in range(0, n, self.step):
            local = slice(start, min(start + self.step, n))
            if self.tp == 1:
                yield local, self.local[local], local
                continue
            ranks = torch.arange(self.tp, device=self.local.device).unsqueeze(1) * n
            index = (ranks + torch.arange(local.start, local.stop, device=self.local.device)).reshape(-1)
            yield local, _gather(self.local[local], self.group, 0), index


class _DeferredWgrad:
    """A microbatch's output-layer weight gradient, computed when called with its (gathered) input:
    added into ``main_grad`` (None returned) where there is one, else returned."""

    def __init__(self, weight, main_grad, stats, local_target, hit, grad_loss, chunk: int):
        self.parts = (weight, main_grad, stats, local_target, hit, grad_loss, chunk)

    def __call__(self, total_input: torch.Tensor) -> torch.Tensor | None:
        weight, main_grad, stats, local_target, hit, grad_loss, chunk = self.parts
        x = total_input.reshape(-1, total_input.size(-1))
        grad_weight = torch.zeros_like(weight) if main_grad is None else None
        into = main_grad if grad_weight is None else grad_weight
        for start in range(0, x.size(0), chunk):
            rows = slice(start, start + chunk)
            grad = _logits_grad(x[rows], weight, stats, rows, local_target, hit, grad_loss)
            wgrad_gemm_accum_fp32(x[rows], grad, into)
            del grad
        return grad_weight


def linear_cross_entropy(
    input_: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    sequence_parallel: bool = False,
    chunk_tokens: int | None = None,
    grad_output_buffer: list | None = None,
    wgrad_deferral_limit: int = 0,
) -> torch.Tensor:
    """Per-token loss with ``target``'s shape, fp32, of the output layer ``input_ @ weight.T`` (input
    [s, b, h], this rank's sequence shard under ``sequence_parallel``; weight [V/tp, h]) and the
    vocab-parallel cross entropy, never holding more than ``chunk_tokens`` rows of logits (None: the
    device's default). With a ``grad_output_buffer`` the weight gradient is deferred as
    ``linear_wgrad``'s. Collective over ``tp_group``; the caller copies a non-SP input into the
    tensor-parallel region."""
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(weight.size(0), kernel_device_type(input_))
    loss = LinearCrossEntropy.apply(
        input_, weight, target, tp_group, sequence_parallel, chunk_tokens, grad_output_buffer,
        wgrad_deferral_limit,
    )  # fmt: skip
    return loss.view_as(target)


def output_layer_cross_entropy(
    layer, input_: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """What ``layer(input_, weight)`` then ``vocab_parallel_cross_entropy`` give, fused: ``layer`` is the
    output ``ColumnParallelLinear`` (its groups, sequence parallelism and wgrad deferral), ``target``
    [s, b]. Collective over the layer's tensor-parallel group."""
    weight = layer.weight if weight is None else weight
    if layer.bias is not None or layer.gather_output or layer.explicit_expert_comm:
        raise NotImplementedError("the fused loss is the output layer's: no bias, no gather, no experts")
    sp = layer.sequence_parallel
    input_parallel = input_ if sp else copy_to_tensor_model_parallel_region(input_, layer.tp_group)
    buffer, limit = None, layer.config.wgrad_deferral_limit
    if layer.deferring_wgrad(weight):
        if defers_wgrad(layer.embedding_activation_buffer, limit):
            layer.embedding_activation_buffer.append(input_parallel.detach())  # values only, as unfused
        buffer = layer.grad_output_buffer
    return linear_cross_entropy(
        input_parallel, weight, target, layer.tp_group, sp, chunk_tokens, buffer, limit
    )
