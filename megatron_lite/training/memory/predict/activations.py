"""Predicted saved-for-backward bytes of one layer, one model chunk and one pipeline rank's step.

What each op of our model saves is derived in predict/stages.py's docstring; here it is counted as
storages (a dict of named byte counts, a storage shared by several saved tensors counted once, as
the ActivationMemoryTracker counts them). :func:`chunk_activations` gives a chunk-microbatch's kept
bytes after its forward and the most it holds during its backward (recomputation re-saves one unit);
predict/schedule.py plays the pipeline schedule's forwards and backwards over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.fusions.fused_bias_swiglu import fuses
from megatron_lite.core.transformer.dot_product_attention import keeps_probabilities
from megatron_lite.training.memory.predict.lora import lora_layer_saves, lora_of, output_adapter_saves
from megatron_lite.training.memory.predict.moe import is_moe, moe_mlp_saves


@dataclass(frozen=True)
class Shape:
    """The per-microbatch sizes the saves are made of, for tensor-parallel rank 0 of a CP rank."""

    tokens: int  # s / cp * b: the CP-local tokens of a microbatch
    norm_tokens: int  # tokens / tp under sequence parallelism, else tokens
    seq: int  # the whole sequence s (keys and values after the CP all-gather)
    local_seq: int  # s / cp
    batch: int  # the micro-batch size b
    elt: int  # bytes of an activation element (2 with bf16, else 4)
    m: object  # the GPTModelProvider
    routing: str = "balanced"  # a MoE layer's token counts when the config leaves them open (predict/moe.py)
    device: str = "cpu"  # whose kernels: attention with dropout keeps its probabilities on the CPU only
    lora: object = None  # the run's LoRA (predict/lora/): frozen base weights, adapters
    packed: bool = False  # SFT rows with boundaries: attention example by example (packed_attention)


def make_shape(config, routing: str = "balanced", device_type: str = "cpu") -> Shape:
    m = config.model
    tokens = m.seq_length // m.context_parallel_size * config.train.micro_batch_size
    norm_tokens = tokens // m.tensor_model_parallel_size if m.sequence_parallel else tokens
    elt = 2 if (m.bf16 or m.fp16) else 4
    seq = m.seq_length
    batch = config.train.micro_batch_size
    return Shape(
        tokens, norm_tokens, seq, seq // m.context_parallel_size, batch, elt, m, routing, device_type,
        lora_of(config), packed_attention(config),
    )  # fmt: skip


def packed_attention(config) -> bool:
    """Whether the run's rows reach attention with boundaries (gpt_step.get_batch: SFT rows one per micro
    batch, or packs); rows of one example each at a larger micro batch run the whole-row attention."""
    micro_batch_one = config.train.micro_batch_size == 1 or getattr(config.dataset, "packing", False)
    # The dataset config's ``sft``, as training/utils/packed_seq_utils.batches_carry_boundaries reads it.
    return bool(getattr(config.dataset, "sft", False)) and micro_batch_one


def _rotary_dim(m) -> int:
    return int(m.kv_channels * m.rotary_percent) if m.rotary_percent < 1.0 else m.kv_channels


def _norm_saves(x: Shape, name: str) -> dict[str, int]:
    """A norm's saves: its input itself and its statistics, LayerNorm's mean and rstd (activation
    dtype), RMSNorm's rstd (fp32; fusions/fused_rms_norm, as Transformer Engine's)."""
    h, t = x.m.hidden_size, x.norm_tokens
    stats = 2 * t * x.elt if x.m.normalization == "LayerNorm" else t * 4
    return {f"{name}.input": t * h * x.elt, f"{name}.stats": stats}


def _attention_parts(x: Shape) -> tuple[dict, dict, dict]:
    """(q/k/v storages entering core attention, what core attention saves, linear_proj's input).
    Storages are keyed by name so one shared by q, k and v (the QKV output ``mixed``) counts once."""
    m, t, e = x.m, x.tokens, x.elt
    tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
    heads, d = m.num_attention_heads // tp, m.kv_channels
    groups = (m.num_query_groups or m.num_attention_heads) // tp
    b = x.batch
    rope = m.position_embedding_type == "rope"
    mixed = {"qkv.output": t * (heads + 2 * groups) * d * e}
    # q, k and v are views of the QKV output, unless q is rotated or regrouped (GQA's reshape copies):
    # then all three are copies and the QKV output is freed (attention.py).
    if rope or heads != groups:
        q, k, v = {"q": t * heads * d * e}, {"k": t * groups * d * e}, {"v": t * groups * d * e}
    else:
        q = k = v = mixed
    inputs = {**q, **k, **v}
    out = {"core_attention.output": t * heads * d * e}
    if keeps_probabilities(m.attention_dropout, cp > 1, heads != groups, e == 2, x.device):
        # PyTorch's math path: scaled q and k, softmax, dropout mask and dropped probabilities, v
        # (GQA's k and v expanded to all heads); its output is copied by the reshape before linear_proj.
        probs = b * heads * x.local_seq * x.seq * e
        core = {
            "q.scaled": t * heads * d * e,
            "k.scaled": b * heads * x.seq * d * e,
            "softmax": probs,
            "dropout.mask": probs,
            "dropout.output": probs,
        }
        core.update(v if heads == groups and cp == 1 else {"v.expanded": b * heads * x.seq * d * e})
        return inputs, core, {"linear_proj.input": t * heads * d * e}
    # A fused kernel (the CPU's flash; CUDA's flash or memory-efficient one, which apply dropout inside
    # themselves): q, k, v, its output and the log-sum-exp (fp32).
    core = {**q, "logsumexp": t * heads * 4, **out}
    # Packed rows: each example's kernel keeps its own output; linear_proj keeps its input, the [s, b, ·]
    # copy of their concatenation (an unpacked row's output is that layout already, one storage).
    proj = {"linear_proj.input": t * heads * d * e} if x.packed else out
    if cp > 1:  # gathered keys and values, and the positional mask as an additive float mask
        core.update({"k.gathered": b * groups * x.seq * d * e, "v.gathered": b * groups * x.seq * d * e})
        core["cp.mask"] = x.local_seq * x.seq * e
    else:
        core.update({**k, **v})
    return inputs, core, proj


def layer_saves(
    x: Shape, selective: bool = True, moe: bool = False, local_index: int = 0, grad_in: bool = True
) -> dict[str, int]:
    """Every storage one layer saves in one microbatch's forward; with ``selective`` (and the config's
    selective recomputation) the checkpointed modules keep only their inputs. ``moe``: the layer's
    MLP is a MoE layer (predict/moe.py), for the Shape's routing. With LoRA (predict/lora/), for
    the layer at ``local_index`` in its chunk, whose input requires a gradient unless not ``grad_in``."""
    saves = _base_layer_saves(x, selective, moe)
    if x.lora is None:
        return saves
    return lora_layer_saves(x, saves, local_index, grad_in, moe)[0]


def _base_layer_saves(x: Shape, selective: bool, moe: bool) -> dict[str, int]:
    m, t, tn, e, h = x.m, x.tokens, x.norm_tokens, x.elt, x.m.hidden_size
    tp = m.tensor_model_parallel_size
    sel = m.recompute_granularity == "selective" and selective
    saves = _norm_saves(x, "input_layernorm")
    saves["linear_qkv.input"] = tn * h * e  # the norm's output (the local shard under SP)
    if m.position_embedding_type == "rope":
        saves["rope.cos_sin"] = 4 * x.local_seq * _rotary_dim(m) * 4  # cos and sin (fp32), for q and k
    inputs, core, proj = _attention_parts(x)
    if sel and "core_attn" in m.recompute_modules:
        saves.update({**inputs, **proj})
    else:
        saves.update({**core, **proj})
    if m.hidden_dropout > 0.0:
        saves["attention.dropout.mask"] = tn * h  # a bool mask (native_dropout)
    saves.update(_norm_saves(x, "pre_mlp_layernorm"))
    saves["linear_fc1.input"] = tn * h * e  # a MoE layer's router input: the same storage
    if moe:
        saves.update(moe_mlp_saves(x, x.routing))
    elif not (sel and "mlp" in m.recompute_modules):
        ffn = m.ffn_hidden_size // tp
        saves["linear_fc1.output"] = t * ffn * (2 if m.gated_linear_unit else 1) * e  # the activation's input
        if m.gated_linear_unit and not fuses(m):
            saves["activation.output"] = t * ffn * e  # act(gate), saved by the product with value
        saves["linear_fc2.input"] = t * ffn * e
    if m.hidden_dropout > 0.0:
        saves["mlp.dropout.mask"] = tn * h
    return saves


# What a layer saved after core attention / the MLP: released by the time backward reaches them.
_AFTER_CORE = (
    "core_attention.output", "linear_proj.input", "attention.dropout.mask", "pre_mlp_layernorm.input",
    "pre_mlp_layernorm.stats", "linear_fc1.input", "linear_fc1.output", "activation.output",
    "linear_fc2.input", "mlp.dropout.mask",
)  # fmt: skip
_MLP = ("linear_fc1.output", "activation.output", "linear_fc2.input")


def selective_backward_extra(x: Shape) -> int:
    """Selective recomputation in backward: the most the last layer's recomputed module re-saves,
    less what that layer already released after it (its later parts' backward ran first)."""
    m = x.m
    full, kept = layer_saves(x, selective=False), layer_saves(x)
    extra = 0
    if "core_attn" in m.recompute_modules:
        _, core, _ = _attention_parts(x)
        transient = sum(v for k, v in core.items() if k not in kept)
        if "core_attention.output" in core:  # the flash kernel's recompute makes a new output
            transient += core["core_attention.output"]
        extra = max(extra, transient - sum(kept.get(k, 0) for k in _AFTER_CORE))
    if "mlp" in m.recompute_modules:
        transient = sum(full[k] for k in _MLP if k in full)
        extra = max(extra, transient - kept.get("mlp.dropout.mask", 0))
    return extra


def embedding_saves(x: Shape) -> int:
    """The first chunk's embedding: the token ids (with tp > 1 their local copy and the out-of-range
    mask), the position ids for learned positions; nothing with LoRA's frozen embedding."""
    m, t = x.m, x.tokens
    if x.lora is not None:
        return 0
    saves = t * 8 + (t if m.tensor_model_parallel_size > 1 else 0)
    return saves + (t * 8 if m.position_embedding_type == "learned_absolute" else 0)


def vocab_per_rank(x: Shape) -> int:
    """The padded vocabulary's share of one tensor-parallel rank."""
    return x.m.padded_vocab_size // x.m.tensor_model_parallel_size


def loss_saves(x: Shape) -> int:
    """The last chunk's saves from the cross entropy on: its fp32 softmax over this rank's vocabulary,
    its target mask (bool) and local targets (int64), and the loss mask (fp32). The fused loss
    (--cross-entropy-loss-fusion) keeps token-sized tensors only: each token's max (fp32) and the
    storage its sum shares with the target logits (2 fp32), beside the same targets, mask and loss mask."""
    t = x.tokens
    if x.m.cross_entropy_loss_fusion:
        return t * (4 + 8) + t * (1 + 8) + t * 4
    return t * vocab_per_rank(x) * 4 + t * (1 + 8) + t * 4


def output_saves(x: Shape) -> int:
    """The last chunk's final norm, the output layer's input, and the loss's saves."""
    norm = sum(_norm_saves(x, "final_layernorm").values())
    if x.lora is not None:  # a frozen output layer keeps no input; its adapter, if any, does
        return norm + sum(output_adapter_saves(x).values()) + loss_saves(x)
    return norm + x.norm_tokens * x.m.hidden_size * x.elt + loss_saves(x)


def deferred_wgrad_bytes(x: Shape, num_microbatches: int) -> int:
    """The last stage's extra bytes under --defer-embedding-wgrad-compute, over its saved-tensor peak:
    each of the n deferred microbatches' output-layer input (t'h e) and output gradient (t V/tp e) is
    held until the flush. When the last microbatch is deferred too, its input is already counted as
    saved at that peak: n - 1 inputs then, n otherwise (exact for plain 1F1B, whose last stage peaks
    at every microbatch; an upper bound under interleaving, whose last rank peaks before its flush)."""
    m = x.m
    if not m.defer_embedding_wgrad_compute:
        return 0
    n = min(m.wgrad_deferral_limit or num_microbatches, num_microbatches)
    inputs = n - 1 if n == num_microbatches else n
    # Fused loss: no output gradient, but each token's max and sum, targets, hits and loss gradient.
    per_microbatch = x.tokens * 28 if m.cross_entropy_loss_fusion else x.tokens * vocab_per_rank(x) * x.elt
    return inputs * x.norm_tokens * m.hidden_size * x.elt + n * per_microbatch


@dataclass(frozen=True)
class ChunkActivations:
    """A chunk-microbatch's bytes: ``kept`` from the end of its forward to its backward, ``peak`` the
    most it holds during its backward (above ``kept`` when recomputation re-saves a unit)."""

    layers: int
    kept: int
    peak: int
    embedding: int
    output: int


def _recompute_units(layers: int, m) -> tuple[list[list[int]], int]:
    """(recomputed units of layer indices, layers after them kept whole) under full recomputation."""
    n = m.recompute_num_layers or 1
    if m.recompute_method == "uniform":
        return [list(range(i, min(i + n, layers))) for i in range(0, layers, n)], 0
    recomputed = min(n, layers)
    return [[i] for i in range(recomputed)], layers - recomputed


def chunk_layer_bytes(x: Shape, layers: int, offset: int = 0, first: bool = False) -> list[int]:
    """What each of a chunk's layers (global indices from ``offset``) saves per microbatch: a MoE
    layer's routed part for the Shape's routing; ``first``: the model's first chunk (its input, the
    embedding's output, needs no gradient when LoRA froze the embedding)."""
    kinds = [is_moe(x.m, i) for i in range(offset, offset + layers)]
    if x.lora is None:
        return [round(sum(layer_saves(x, moe=moe).values())) for moe in kinds]
    # LoRA on the first chunk: nothing requires a gradient before the first adapter.
    grad, out = not first, []
    for i, moe in enumerate(kinds):
        saves, grad = lora_layer_saves(x, _base_layer_saves(x, True, moe), i, grad, moe)
        out.append(round(sum(saves.values())))
    return out


def chunk_activations(x: Shape, layers: int, pre: bool, post: bool, offset: int = 0) -> ChunkActivations:
    """Kept and backward-peak bytes of one microbatch through a chunk of ``layers`` layers (global
    indices from ``offset``), with the embedding (``pre``) and the output layer and loss (``post``)."""
    m = x.m
    per_layer = chunk_layer_bytes(x, layers, offset, first=pre)
    emb = embedding_saves(x) if pre else 0
    out = output_saves(x) if post else 0
    # Under SP the first layer on the first stage saves a view of the whole embedding output (the
    # scatter's chunk is contiguous, so no copy is made): the full sequence's storage stays alive.
    # With LoRA that norm keeps nothing (the frozen embedding's output needs no gradient).
    sp_first = (x.tokens - x.norm_tokens) * m.hidden_size * x.elt if pre and m.sequence_parallel else 0
    sp_first = 0 if x.lora is not None else sp_first
    if m.recompute_granularity != "full" or layers == 0:
        kept = emb + (sp_first if layers else 0) + sum(per_layer) + out
        peak = kept
        if m.recompute_granularity == "selective" and layers:
            peak = max(kept, kept - out + selective_backward_extra(x))
        return ChunkActivations(layers, kept, peak, emb, out)
    units, whole = _recompute_units(layers, m)
    distribute = m.distribute_saved_activations and not m.sequence_parallel
    unit_input = x.norm_tokens * m.hidden_size * x.elt
    if distribute:
        unit_input //= m.tensor_model_parallel_size
    inputs = [unit_input for _ in units]
    if units and sp_first:
        inputs[0] += sp_first
    rope = 0
    if m.position_embedding_type == "rope" and units:  # the angles are a checkpoint argument too
        rope = x.local_seq * _rotary_dim(m) * 4
    kept = emb + rope + sum(inputs) + sum(per_layer[layers - whole :]) + out
    # Backward: the loss, output layer and the whole layers go first; then each unit, last first,
    # re-saves its layers while the inputs of it and of the units before it are still held. Its first
    # norm saves the kept input's own storage unless that was split over TP (then a gathered copy).
    peak = kept
    for u, unit in enumerate(units):
        held = emb + rope + sum(inputs[: u + 1]) + sum(per_layer[i] for i in unit)
        if not distribute:
            held -= unit_input  # the recompute's first norm saves the very storage kept as the input
        peak = max(peak, held)
    return ChunkActivations(layers, kept, peak, emb, out)
