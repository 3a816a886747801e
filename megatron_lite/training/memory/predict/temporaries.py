"""Predicted temporaries: what is alive beside the saved activations at a stage's largest instants.

A stage peaks at one of a few instants, each measured op by op on CPU (the allocated-bytes tracker
names the op at the peak) and counted here tensor by tensor, for t = s b / cp tokens, t' = t / tp under
sequence parallelism, V' = V / tp, f = the MLP's fc2 width per TP rank, element size e:

- the cross entropy's shift on the last chunk (``logits -= max``, in place as megatron-core's): the
  logits t V' e and, when e is 2, their fp32 upcast t V' 4, which is shifted, exponentiated and
  normalised in place and becomes the saved softmax (fp32 logits are that buffer themselves). The
  softmax, its masks and the loss mask are not saved yet at that instant;
- the output layer's backward: its input gradient t h e (the whole sequence before SP's
  reduce-scatter), under SP the re-gathered input t h e, and its weight gradient V' h e (with
  gradient-accumulation fusion none: on CUDA and in fp32 the GEMM adds into main_grad, on a CPU bf16
  run slices of tokens upcast), beside all of the chunk's saves (the cross entropy's gradient is its own
  softmax buffer, modified in place); the fused loss's (--cross-entropy-loss-fusion) holds one chunk's
  rows of each instead, and no weight gradient (it adds into main_grad);
- a layer's backward, which starts with linear_fc2's: the output gradient t' h e (received from the
  next stage, or the final norm's), gathered under SP (t h e), the input gradient t f e and the weight
  gradient h f e (as the output layer's with fusion, except a MoE layer's experts, which do not fuse),
  beside everything the chunk saved; a MoE layer's grouped experts' fc2 holds its R routed rows'
  output gradient twice (and transposed), their input gradient R f e and every local expert's weight
  gradient (frozen experts: no weight gradient, the stacked weights instead); with LoRA
  (predict/lora/) the frozen base's input gradient, the adapter's and their sum;
- the optimizer step, with no activations: get_grad_norm_fp32's fp64 copy of one gradient at a time
  (8 bytes an element of the largest parameter or distributed-optimizer shard piece), AdamW's
  sqrt(exp_avg_sq) and its quotient (two fp32 copies of the largest parameter with PyTorch's
  single-tensor AdamW, the CPU default; one fp32 list over all parameters with the foreach AdamW, the
  CUDA default), and with bf16 parameters and the plain optimizer the fp32 copies of every gradient
  that the fp32 masters take for the step.

No temporary, measured: the first stage's embedding backward (it adds into ``main_grad`` in place,
embedding_grad.py) and the distributed optimizer's parameter all-gather (into the parameters' own
buffer). The deferred output-layer wgrad buffers (--defer-embedding-wgrad-compute) are added to the
schedule's instant as stages.py's ``deferred_wgrad_bytes``; recomputation's re-saved unit is in the
chunk's backward peak (activations.py).

Left out: buffers of a t h e or smaller each, under 1% of a stage at hidden 128 and up to 7% of a toy
model of hidden 64 (interleaved with full recomputation; the dry run measures them): the activations
and gradients a pipeline schedule has received ahead (the interleaved one holds several), recomputation's saved RNG states
(5 KB each), the batch, loss scalars, kernel-internal scratch. On CUDA the same tensors are allocated except the attention
kernels' own, and the caching allocator rounds each block to 512 bytes: not verified on a GPU yet.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.fusions.fused_linear_cross_entropy import default_chunk_tokens, local_rows_per_chunk
from megatron_lite.core.fusions.fused_weight_gradient import upcast_token_rows
from megatron_lite.training.memory.predict.activations import (
    ChunkActivations,
    Shape,
    loss_saves,
    vocab_per_rank,
)
from megatron_lite.training.memory.predict.lora import (
    experts_fc2_adapted,
    lora_fc2_backward_extra,
    lora_fc2_released,
)
from megatron_lite.training.memory.predict.moe import expert_sizes, routed_rows


def loss_forward_extra(x: Shape) -> int:
    """At the cross entropy's shift: the logits and their fp32 upcast (when not fp32), shifted in place."""
    t, vocab = x.tokens, vocab_per_rank(x)
    upcast = t * vocab * 4 if x.elt != 4 else 0
    return t * vocab * x.elt + upcast


def fused_chunk_tokens(x: Shape) -> int:
    """The fused loss's rows per chunk (gathered rows under SP: each rank's ``chunk // tp``): the
    flag's, else the device's default."""
    chunk = x.m.cross_entropy_fusion_chunk_tokens or default_chunk_tokens(vocab_per_rank(x), x.device)
    tp = x.m.tensor_model_parallel_size if x.m.sequence_parallel else 1
    return min(local_rows_per_chunk(chunk, tp), x.norm_tokens) * tp


def fused_loss_forward_extra(x: Shape) -> int:
    """The fused loss's forward, at a chunk's shift: under SP the chunk's gathered rows C h e, its
    logits C V' e and their fp32 upcast, and the token-sized results being filled (max, sum, target
    logit: fp32; local targets int64; the mask)."""
    m, t, e, chunk = x.m, x.tokens, x.elt, fused_chunk_tokens(x)
    vocab = vocab_per_rank(x)
    gathered = chunk * m.hidden_size * e if m.sequence_parallel else 0
    return gathered + chunk * vocab * e + (chunk * vocab * 4 if e != 4 else 0) + t * (12 + 8 + 1)


def fused_output_backward_extra(x: Shape) -> int:
    """The fused loss's backward: this rank's input gradient t' h e, the targets' hits (fp32), and one
    chunk's buffers at their largest: under SP its gathered rows C h e, then either its logits beside
    their fp32 softmax or the softmax beside its cast (C V' (4 + e); fp32: one buffer), or the cast
    beside its input gradient C h e and that gradient's reduce-scatter (gloo's copy C h e, and this
    rank's rows), or the cast beside the weight gradient's way into main_grad (upstream's
    gradient-accumulation fusion: no weight-sized gradient; see :func:`fused_wgrad_extra`)."""
    m, e, h, chunk = x.m, x.elt, x.m.hidden_size, fused_chunk_tokens(x)
    sp, tp, vocab = m.sequence_parallel, m.tensor_model_parallel_size, vocab_per_rank(x)
    base = x.norm_tokens * h * e + x.tokens * 4
    gathered = chunk * h * e if sp else 0
    index = chunk * 8 * (2 if sp else 1)  # the hits' arange (and under SP the rows' positions)
    softmax = chunk * vocab * (e + 4 if e != 4 else 4)
    cast = chunk * vocab * e
    scatter = (chunk * h * e * (2 if x.device == "cpu" else 1) + chunk // tp * h * e) if sp else 0
    wgrad = fused_wgrad_extra(x, vocab, h, chunk)
    return base + gathered + index + max(softmax, cast + max(scatter, wgrad))


def output_backward_extra(x: Shape) -> int:
    """The output layer's backward: input gradient, the re-gathered input under SP, weight gradient
    (weight-sized, or with gradient-accumulation fusion its way into main_grad)."""
    m, t, e, h, vocab = x.m, x.tokens, x.elt, x.m.hidden_size, vocab_per_rank(x)
    full = t * h * e
    wgrad = fused_wgrad_extra(x, vocab, h, t) if m.gradient_accumulation_fusion else vocab * h * e
    return full + (full if m.sequence_parallel else 0) + wgrad


def fused_wgrad_extra(x: Shape, out_features: int, in_features: int, tokens: int) -> int:
    """A weight gradient added straight into the fp32 main_grad (fusions/fused_weight_gradient): nothing
    in fp32 or on CUDA (the GEMM's fp32 output is main_grad), else each slice of tokens upcast."""
    if x.elt == 4:
        return 0
    rows = min(upcast_token_rows(in_features, out_features, x.device), tokens)
    return rows * (in_features + out_features) * 4


def layer_backward_extra(x: Shape) -> int:
    """linear_fc2's backward: its output gradient (gathered under SP), input gradient and weight
    gradient (weight-sized, or with gradient-accumulation fusion its way into main_grad)."""
    m, t, e, h = x.m, x.tokens, x.elt, x.m.hidden_size
    f = m.ffn_hidden_size // m.tensor_model_parallel_size
    grad_output = x.norm_tokens * h * e + (t * h * e if m.sequence_parallel else 0)
    grouped = grouped_experts_backward_extra(x) if m.num_moe_experts and m.moe_grouped_gemm else 0
    if x.lora is not None:
        return grad_output + max(lora_fc2_backward_extra(x, f), grouped)
    # The routed experts' grouped GEMM returns weight-sized gradients, fusion or not.
    fused = m.gradient_accumulation_fusion and not m.num_moe_experts
    wgrad = fused_wgrad_extra(x, h, f, t) if fused else h * f * e
    return grad_output + max(t * f * e + wgrad, grouped)


def grouped_experts_backward_extra(x: Shape) -> int:
    """The routed experts' fc2 backward (grouped GEMM, measured on CPU). Trainable weights: at the
    weight gradient, the rows' output gradient R h e and its transposed copy, the input gradient
    R f e and the local experts' weight gradients E_l h f e. Frozen ones (LoRA: no weight gradient
    is computed): at the input gradient, the rows' output gradient R h e, the stacked weights the
    grouped GEMM reads E_l h f e and the input gradient R f e; with an adapter on the experts' fc2
    its input gradient R f e beside them (the adapter's backward runs first)."""
    m, e, h = x.m, x.elt, x.m.hidden_size
    local, etp, _ = expert_sizes(m)
    f = m.moe_ffn_hidden_size // etp
    rows, _ = routed_rows(m, x.norm_tokens, x.routing)
    if x.lora is None:
        return round(2 * rows * h * e + rows * f * e + local * h * f * e)
    extra = rows * h * e + local * h * f * e + rows * f * e
    if experts_fc2_adapted(x):
        extra += rows * f * e
    return round(extra)


@dataclass(frozen=True)
class ChunkTransients:
    """A chunk-microbatch's largest instants, as (bytes, of which saved activations): ``forward``
    above what was held before its forward, ``backward`` above what was held before its backward less
    its own kept bytes."""

    forward: tuple[int, int]
    backward: tuple[int, int]


def chunk_transients(x: Shape, chunk: ChunkActivations, post: bool) -> ChunkTransients:
    layer = layer_backward_extra(x) if chunk.layers else 0
    # LoRA: linear_fc2's adapter has released what it saved by the instant its gradients add up.
    released = lora_fc2_released(x) if chunk.layers and x.lora is not None else 0
    if not post:
        return ChunkTransients(
            (chunk.kept, chunk.kept), (chunk.peak + layer - released, chunk.peak - released)
        )
    fused = x.m.cross_entropy_loss_fusion
    before_loss = chunk.kept - loss_saves(x)
    loss_extra = fused_loss_forward_extra(x) if fused else loss_forward_extra(x)
    forward = max((before_loss + loss_extra, before_loss), (chunk.kept, chunk.kept))
    # After the output layer's backward its saves are gone; recomputation then re-saves a unit.
    after_output = chunk.peak if chunk.peak > chunk.kept else chunk.kept - chunk.output
    if fused:
        output = (chunk.kept + fused_output_backward_extra(x), chunk.kept)
    else:
        output = (chunk.kept + output_backward_extra(x), before_loss)  # the softmax is the gradient now
    layer_instant = (after_output + layer - released, after_output - released)
    return ChunkTransients(forward, max(output, layer_instant))


def optimizer_step_extra(
    largest_piece: int, total_pieces: int, cloned_grads: int, device_type: str = "cpu"
) -> int:
    """The optimizer step's scratch: the gradient norm's fp64 copy, AdamW's square-root temporaries
    (per parameter on CPU, one list for all on CUDA) and ``cloned_grads`` elements of fp32 gradient
    copies held through the step."""
    norm = 8 * largest_piece
    adam = 4 * total_pieces if device_type == "cuda" else 8 * largest_piece
    return 4 * cloned_grads + max(norm, adam)
