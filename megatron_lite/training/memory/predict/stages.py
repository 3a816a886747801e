"""Predicted memory of every pipeline stage, for the exact layout of a config (a prediction, not a
measurement: logged as ``memory/pp-stage-<i>/predicted-*`` beside the measured ``mem-*`` keys).

:func:`predict_memory_per_stage` is a pure function of a validated ConfigContainer: no world, no
torch.distributed, no model is built. Each entry describes one rank of a pipeline stage: tensor-parallel
rank 0 (every TP rank holds the same bytes: the layers split evenly) and data-parallel x context-
parallel rank ``dp_rank`` (0 by default; DP ranks differ only in the distributed optimizer's shard,
by a few parameter pieces and the bucket padding).

Weights, gradients, optimizer (predict/params.py): the parameters of each model chunk from
the real layer assignment (``get_num_layers_to_build``, vp included), the embedding on chunk 0 of
rank 0, the final norm and output layer on the last chunk of the last rank (with tied embeddings and
pp > 1 the last stage builds its own copy), in the params' dtype (bf16 with --bf16); gradients in
DDP's fp32 buffers, padded per bucket to a multiple of dp x cp under the distributed optimizer; AdamW's
fp32 exp_avg and exp_avg_sq, a 4-byte ``step`` scalar per parameter and fp32 masters of bf16 params,
over the whole parameters or, with --use-distributed-optimizer, over the pieces of this rank's shards.

Activations (predict/activations.py), counted as what OUR autograd saves, op by op, per layer
and microbatch, for t = s b / cp tokens, t' = t / tp under sequence parallelism (else t), element
size e (2 with bf16, 4 without), heads a and query groups g per TP rank, head size d, MLP width f per
TP rank (fc1 2f when gated) and the CPU flash attention kernel:

- input_layernorm: its input t'h e, and LayerNorm its mean and rstd 2t'e, RMSNorm its rstd t'4
  (fusions/fused_rms_norm: what Transformer Engine's keeps); linear_qkv its
  input (the norm's output, the local shard under SP) t'h e;
- the QKV output t(a + 2g)d e, which v (always) and q, k (unless rotated, or q regrouped by GQA) view;
  rotated q and k (t a d e, t g d e) and their cos/sin (4 s/cp rot 4); core attention's output t a d e
  (shared with linear_proj's input) and log-sum-exp t a 4; with cp the gathered k and v (b g s d e
  each) and the additive mask (s/cp s e); with attention dropout the math path's scaled q and k, the
  probabilities, dropout mask and dropped probabilities (3 b a (s/cp) s e) and a copy of the output;
- pre_mlp_layernorm like the first norm, linear_fc1's input t'h e, the activation's input (fc1's
  output, t f e, 2t f e when gated), act(gate) t f e when gated but not SwiGLU (fused:
  fusions/fused_bias_swiglu.py), linear_fc2's input t f e;
- hidden dropout masks t'h twice (native_dropout's bool masks, as CUDA's); residual adds and the TP/SP mappings save nothing.

Without dropout, GQA or rope, and with f = 4h/tp, that is s b h e (4 + 12/tp) + 4 s b (e + a) per layer
(16 s b h e / tp under SP): Korthikanti et al.'s sbh(34 + 5as/h) bytes for 2-byte elements also count
two 1-byte dropout masks and the s x s attention matrices, which the flash kernel never keeps (it
keeps the log-sum-exp instead); the norms' statistics are counted here.
The first chunk adds the token ids (t 8, with tp > 1 a local copy and a bool mask) and position ids
(t 8); under SP the first layer keeps the whole embedding output (the scatter returns a view of it).
The last chunk adds the final norm, the output layer's input, the cross entropy's fp32 softmax over
this rank's vocabulary t V/tp 4, its bool mask and int64 targets t 9, and the fp32 loss mask t 4.

Recomputation: full ``uniform`` keeps each unit's input (t'h e, split over TP by
--distribute-saved-activations; the rotary angles once per chunk), ``block`` keeps the first N layers'
inputs and the rest whole; in backward a unit re-saves its layers while the inputs of it and of the
units before it are held. Selective keeps core attention's (or the MLP's) inputs; in backward the last
layer re-saves the module's internals after releasing what it saved after the module.

A layer in a training step saves exactly what a bare layer forward does (tested to the byte). A step's
per-layer average is higher on the first and last stage only: their chunks also hold the embedding
and, above all, the logits and loss saves (5% of a layer-microbatch on the last stage of the
interleaving test's model), which is where a "7% more per layer" reading comes from.

The counts are PyTorch's CPU kernels', which the tests measure byte for byte. On CUDA the same tensors
are saved except where dropout is on (CUDA's dropout keeps 1-byte masks, and its flash / efficient
attention keeps an RNG state instead of the probabilities): not verified on a GPU yet.

Packed SFT rows (--sft, one row per micro batch with its boundaries; activations.packed_attention):
attention runs example by example (no s x s mask is built), each example's kernel keeping its q, k, v,
output and log-sum-exp as the whole row's does, and linear_proj keeps its own input t a d e (the copy
of the examples' concatenated outputs; a whole row's output is already its layout). With attention
dropout the math path keeps sum_i s_i^2 scores per head where a whole row keeps s^2: predicted for one
example filling the row, the costliest pack (the dry run's fake pack). RoPE takes each token's angle by
its position in its example (a transient gather). The boundaries are host metadata; a middle stage now
also reads its batch (left out, as the batch is). Not counted yet: under CP each example's own mask
and key/value slices (0.1% of a stage at seq 64, cp 2, in the dry run), and what LoRA's linear_proj
adapter reads on packed rows.

--defer-embedding-wgrad-compute: the last stage also holds each deferred microbatch's output-layer
input t'h e and output gradient t V/tp e until the pipeline flush (n gradients and n inputs for n
deferred microbatches, n - 1 inputs when all are deferred: the saved peak counts the last one), in
``total_bytes``.

The schedule: each rank's forwards and backwards in the schedule's own order (plain 1F1B:
``min(pp - rank - 1, m)`` warmup forwards, so at most ``min(pp - rank, m)`` microbatches in flight;
interleaved: upstream's schedule table and warmup), adding a chunk-microbatch's kept bytes at its
forward and releasing them at its backward; the peak is the maximum over the step, including each
backward's recomputation.

LoRA (``config.peft``, predict/lora/): the frozen base keeps its weights only (no gradient buffer,
master or optimizer state: those are the adapters' alone), a frozen linear keeps no input, each adapter
keeps its input and low-rank activation, and nothing before the first adapter of the first stage is
saved; linear_fc2's backward then holds the base's and the adapter's input gradients and their sum.

The allocated peak (``peak_bytes``, beside the measured ``mem-max-allocated``): the static bytes plus the
larger of two instants' dynamic bytes: the schedule's largest instant of saves in flight plus the
temporaries of the op then running (``step_bytes``, temporaries.py), and the optimizer step's scratch
(``optimizer_step_bytes``). Within 1% of the CPU measurement on every stage of the seven layouts of
bench/memory_prediction.py's peak table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.core.pipeline_parallel.schedule_order import forward_backward_order
from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron_lite.training.memory.predict.activations import (
    chunk_activations,
    deferred_wgrad_bytes,
    layer_saves,
    make_shape,
)
from megatron_lite.training.memory.predict.moe import exact_routing
from megatron_lite.training.memory.predict.params import chunk_bounds, param_memory
from megatron_lite.training.memory.predict.schedule import (
    schedule_peak,
    schedule_peak_allocated,
)
from megatron_lite.training.memory.predict.temporaries import (
    chunk_transients,
    optimizer_step_extra,
)
from megatron_lite.training.memory.report import gigabytes

__all__ = ["StageMemoryPrediction", "predict_memory_per_stage", "predicted_memory_metrics"]


@dataclass(frozen=True)
class StageMemoryPrediction:
    """Predicted bytes of one rank (TP rank 0, the given DP x CP rank) of pipeline stage ``pp_rank``."""

    pp_rank: int
    weights_bytes: int
    """Parameters of this rank's model chunks, in their dtype."""
    grads_bytes: int
    """DDP's fp32 gradient buffers, with the distributed optimizer's bucket padding."""
    optimizer_state_bytes: int
    """AdamW moments and step scalars, plus fp32 masters of non-fp32 parameters (this rank's shard
    with the distributed optimizer)."""
    activation_bytes: int
    """Peak bytes of tensors saved for backward over one step."""
    layers: int
    """Transformer layers on this rank, over all its chunks."""
    parameters: int
    """Parameter elements on this rank."""
    in_flight: int
    """Most microbatch-chunks whose activations are held at once."""
    activation_bytes_per_layer_microbatch: int
    """What one layer saves for one microbatch (after selective recomputation, before full)."""
    chunk_kept_bytes: list[int] = field(default_factory=list)
    """Per chunk: one microbatch's saved bytes from its forward until its backward."""
    chunk_backward_peak_bytes: list[int] = field(default_factory=list)
    """Per chunk: the most one microbatch holds during its backward (recomputation included)."""
    embedding_activation_bytes: int = 0
    """First stage: the embedding's saves per microbatch."""
    logits_activation_bytes: int = 0
    """Last stage: the final norm's, output layer's, cross entropy's and loss's saves per microbatch."""
    deferred_wgrad_bytes: int = 0
    """Last stage under --defer-embedding-wgrad-compute: the output layer's inputs and output gradients
    held for the flush, beyond the saved-tensor peak."""
    step_bytes: int = 0
    """The most bytes beyond the static ones during forwards and backwards: the saves in flight and
    the temporaries of the op running (temporaries.py), deferred wgrad buffers included."""
    saved_at_step_peak_bytes: int = 0
    """The saved activations at the instant of ``step_bytes``."""
    optimizer_step_bytes: int = 0
    """The optimizer step's scratch beyond the static bytes."""
    adapter_weights_bytes: int = 0
    """LoRA: the adapters' weights (part of ``weights_bytes``; the rest is the frozen base, which has
    no gradient buffer and no optimizer state: ``grads_bytes`` and ``optimizer_state_bytes`` are the
    adapters')."""
    adapter_activation_bytes_per_layer_microbatch: int = 0
    """LoRA: what one layer's adapters save for one microbatch (part of
    ``activation_bytes_per_layer_microbatch``, which also lacks the inputs frozen linears no longer keep)."""
    activation_bytes_worst: int = 0
    """MoE without padding to capacity: ``activation_bytes`` if every token of the expert group went to
    this rank's experts (an upper bound; ``activation_bytes`` is then balanced routing's). 0 when the
    config fixes the routed rows (dense, or padded to capacity)."""
    total_bytes: int = field(init=False)
    """weights + grads + optimizer state + peak activations + deferred wgrad buffers (a field, so
    ``asdict`` carries it)."""
    peak_bytes: int = field(init=False)
    """The allocated peak: weights + grads + optimizer state + the larger of ``step_bytes`` and
    ``optimizer_step_bytes`` (what ``mem-max-allocated-bytes`` measures)."""
    temporaries_bytes: int = field(init=False)
    """The peak's bytes that are neither static nor saved activations."""

    def __post_init__(self) -> None:
        static = self.weights_bytes + self.grads_bytes + self.optimizer_state_bytes
        total = static + self.activation_bytes + self.deferred_wgrad_bytes
        object.__setattr__(self, "total_bytes", total)
        dynamic = max(self.step_bytes, self.optimizer_step_bytes)
        object.__setattr__(self, "peak_bytes", static + dynamic)
        saved = 0 if self.optimizer_step_bytes > self.step_bytes else self.saved_at_step_peak_bytes
        object.__setattr__(self, "temporaries_bytes", dynamic - saved)


def predict_memory_per_stage(
    config, dp_rank: int = 0, device_type: str = "cpu", routing: str = "balanced"
) -> list[StageMemoryPrediction]:
    """One prediction per pipeline rank for ``config`` (a validated ConfigContainer), for TP rank 0
    and rank ``dp_rank`` of the data-parallel x context-parallel group, on a ``device_type`` device
    ("cpu" or "cuda": their AdamW defaults differ in scratch, and attention with dropout keeps its
    probabilities on the CPU only, dot_product_attention.keeps_probabilities). Pure and cheap: no process group, no
    model. A MoE model's routed rows are ``routing``'s ("balanced" or "worst", predict/moe.py) unless
    the config fixes them; with "balanced" and open rows ``activation_bytes_worst`` holds the bound."""
    m = config.model
    worst = None
    if routing == "balanced" and m.num_moe_experts and not exact_routing(m):
        worst = predict_memory_per_stage(config, dp_rank, device_type, routing="worst")
    pp, vp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    group = m.microbatch_group_size_per_vp_stage or pp
    x = make_shape(config, routing, device_type)
    saves = layer_saves(x)
    per_layer = sum(saves.values())
    adapter_saves = sum(v for k, v in saves.items() if ".adapter." in k)
    stages = []
    for rank in range(pp):
        chunks, transients = [], []
        for vp_stage in range(vp):
            pre, post = chunk_bounds(m, rank, vp_stage)
            layers = get_num_layers_to_build(m, vp_stage, rank)
            offset = get_transformer_layer_offset(m, vp_stage, rank)
            chunks.append(chunk_activations(x, layers, pre, post, offset))
            transients.append(chunk_transients(x, chunks[-1], post))
        events = forward_backward_order(config.num_microbatches, vp, pp, rank, group)
        peak, in_flight = schedule_peak(events, chunks)
        step, saved_then = schedule_peak_allocated(events, chunks, transients)
        deferred = deferred_wgrad_bytes(x, config.num_microbatches) if rank == pp - 1 else 0
        params = param_memory(config, rank, dp_rank)
        scratch = optimizer_step_extra(
            params["largest_piece"], params["total_pieces"], params["cloned_grads"], device_type
        )
        stages.append(
            StageMemoryPrediction(
                pp_rank=rank,
                weights_bytes=params["weights_bytes"],
                grads_bytes=params["grads_bytes"],
                optimizer_state_bytes=params["optimizer_state_bytes"],
                activation_bytes=peak,
                layers=sum(c.layers for c in chunks),
                parameters=params["parameters"],
                in_flight=in_flight,
                activation_bytes_per_layer_microbatch=per_layer,
                chunk_kept_bytes=[c.kept for c in chunks],
                chunk_backward_peak_bytes=[c.peak for c in chunks],
                embedding_activation_bytes=sum(c.embedding for c in chunks),
                logits_activation_bytes=sum(c.output for c in chunks),
                deferred_wgrad_bytes=deferred,
                step_bytes=step + deferred,
                saved_at_step_peak_bytes=saved_then,
                optimizer_step_bytes=scratch,
                activation_bytes_worst=worst[rank].activation_bytes if worst else 0,
                adapter_weights_bytes=params["adapter_weights_bytes"],
                adapter_activation_bytes_per_layer_microbatch=adapter_saves,
            )
        )
    return stages


# Predicted quantity -> the logged name's suffix, beside the measured mem-* keys of each stage.
PREDICTED_KEYS = {
    "weights_bytes": "predicted-weights-gigabytes",
    "grads_bytes": "predicted-grads-gigabytes",
    "optimizer_state_bytes": "predicted-optimizer-state-gigabytes",
    "activation_bytes": "predicted-max-activation-gigabytes",
    "total_bytes": "predicted-total-gigabytes",
    "temporaries_bytes": "predicted-temporaries-gigabytes",
    "peak_bytes": "predicted-max-allocated-gigabytes",
}


WORST_ACTIVATION_KEY = "predicted-max-activation-worst-gigabytes"
ADAPTER_WEIGHTS_KEY = "predicted-adapter-weights-gigabytes"


def predicted_memory_metrics(predictions: list[StageMemoryPrediction]) -> dict[str, float]:
    """``{"memory/pp-stage-<i>/predicted-*-gigabytes": GB}`` (1e9 bytes, 5 significant digits, as the
    measured keys) for every stage."""
    metrics = {
        f"memory/pp-stage-{p.pp_rank}/{name}": gigabytes(getattr(p, attr))
        for p in predictions
        for attr, name in PREDICTED_KEYS.items()
    }
    for p in predictions:  # LoRA: the adapters' share of the weights
        if p.adapter_weights_bytes:
            metrics[f"memory/pp-stage-{p.pp_rank}/{ADAPTER_WEIGHTS_KEY}"] = gigabytes(p.adapter_weights_bytes)
    for p in predictions:  # MoE with open routing: the worst routing's bound beside balanced's
        if p.activation_bytes_worst:
            metrics[f"memory/pp-stage-{p.pp_rank}/{WORST_ACTIVATION_KEY}"] = gigabytes(
                p.activation_bytes_worst
            )
    return metrics
