"""The figures the planner ranks by: none of them a time. For a validated config and its layout:

- the pipeline bubble, Megatron's formula for (interleaved) 1F1B: ``(pp - 1) / (vp m)`` of the ideal
  step, for m microbatches (Narayanan et al. 2021);
- recompute's extra FLOPs as a fraction of the step's. A layer's forward is ``2 t (h q + a d h + h F
  + f h)`` GEMM FLOPs for t tokens (q = (a + 2g) d the QKV width, F = 2f gated or f, f the MLP width)
  plus ``4 b s^2 a d`` for attention's two matrix products over b sequences of s tokens (Megatron's
  count: the full square, not the causal half); the output layer's is ``2 t h V``; a step is three
  forwards (the backward does two GEMMs per forward one). Selective recompute re-runs core attention
  (``4 b s^2 a d`` per layer), full block recompute of N of a chunk's layers re-runs N layers'
  forwards per chunk, and the fused loss re-runs the output layer's GEMM in backward (``2 t h V``);
- bytes each GPU sends plus receives per step, per kind, on the busiest rank, counting what our code
  moves. A ring all-gather or reduce-scatter of a tensor of S bytes (the gathered size) over n ranks
  moves ``2 (n-1)/n S`` per rank, an all-reduce twice that, an all-to-all of S bytes per rank
  ``2 (n-1)/n S``. Per layer and microbatch, with t = s b / cp tokens per rank and element size e:

  TP: with SP, forward all-gathers the inputs of linear_qkv and linear_fc1 and reduce-scatters the
  outputs of linear_proj and linear_fc2 (4 x S, S = t h e); backward all-gathers the two saved input
  shards again for the weight gradients, reduce-scatters the two input gradients and all-gathers the
  two output gradients (6 x S); without SP, two all-reduces forward and two backward. The output
  layer adds one all-gather and one reduce-scatter (SP) or one all-reduce (no SP), the vocab-parallel
  cross entropy three all-reduces of t fp32 values; recomputed layers repeat their forward's share.
  CP (our attention all-gathers k and v along the sequence): forward two all-gathers of
  ``b (g/tp) s d e`` each, backward two all-reduces of the same size; selective and full recompute
  repeat the forward's. PP: a middle rank receives and sends one activation and one gradient of
  ``(s/cp) b h e`` (divided by tp under SP) per microbatch and chunk. DP (over the dp x cp group, once
  per step): the distributed optimizer reduce-scatters the fp32 gradient buffer and all-gathers the
  bf16 parameters; plain DDP all-reduces the gradient buffer. EP: per MoE layer, forward dispatch and
  combine all-to-alls of the routed rows (t k h e under balanced routing, k the router's top-k),
  backward two more.

Which bytes cross nodes: ranks are laid out as Megatron's ``tp-cp-ep-dp-pp`` (tp fastest), so a group
of n ranks at stride r stays inside a node of ``GPUS_PER_NODE`` when r n <= GPUS_PER_NODE.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_lite.run_modes.plan.layouts import GPUS_PER_NODE, Layout


@dataclass(frozen=True)
class Figures:
    """The ranking's figures for one candidate (fractions, and bytes per GPU per step)."""

    bubble: float
    recompute: float
    comm_bytes: dict[str, float] = field(default_factory=dict)
    """Per kind ("TP", "CP", "PP", "DP", "EP"): bytes sent + received per GPU per step."""
    inter_node_bytes: float = 0.0
    """The part of ``comm_bytes`` whose groups span nodes."""

    @property
    def overhead(self) -> float:
        """The bubble plus recompute's extra FLOPs: the first ranking key."""
        return self.bubble + self.recompute

    @property
    def total_bytes(self) -> float:
        return sum(self.comm_bytes.values())

    def rank_key(self) -> tuple:
        """Lower is better: the overhead in whole percent (closer is a tie), then the bytes crossing nodes,
        then all bytes (TP's, inside a node, last)."""
        return round(self.overhead * 100), round(self.inter_node_bytes / 1e6), round(self.total_bytes / 1e6)


def _ring(n: int, size: float) -> float:
    """Bytes one rank sends plus receives in a ring all-gather or reduce-scatter of ``size`` bytes."""
    return 2 * (n - 1) / n * size if n > 1 else 0.0


def _flops(m, s: int, b: int) -> tuple[float, float, float]:
    """(a layer's forward FLOPs, its core attention's, the output layer's) per microbatch."""
    h, a, d = m.hidden_size, m.num_attention_heads, m.kv_channels
    g = m.num_query_groups or a
    t = s * b
    f = m.moe_ffn_hidden_size if m.num_moe_experts else m.ffn_hidden_size
    topk = m.moe_router_topk if m.num_moe_experts else 1
    fc1 = f * (2 if m.gated_linear_unit else 1)
    gemms = 2 * t * (h * (a + 2 * g) * d + a * d * h + topk * (h * fc1 + f * h))
    attention = 4 * b * s * s * a * d
    return gemms + attention, attention, 2 * t * h * m.padded_vocab_size


def recompute_fraction(config, layout: Layout) -> float:
    """Recompute's and the fused loss's extra FLOPs over the step's (module docstring)."""
    m = config.model
    layer, attention, output = _flops(m, m.seq_length, config.train.micro_batch_size)
    step = 3 * (m.num_layers * layer + output)
    extra = 0.0
    if layout.recompute == "selective":
        extra += m.num_layers * attention
    elif layout.recompute == "full":
        chunks = layout.pp * layout.vp
        extra += min(m.num_layers, layout.recompute_layers * chunks) * layer
    if layout.fused_loss:
        extra += output
    return extra / step


def _crosses(stride: int, size: int) -> bool:
    return size > 1 and stride * size > GPUS_PER_NODE


def figures(config, layout: Layout, predictions) -> Figures:
    """The ranking figures of ``layout`` (``config`` its validated ConfigContainer, ``predictions`` its
    stages' predictions, whose gradient and weight bytes the DP figure uses)."""
    m = config.model
    tp, pp, vp, cp, dp, ep = layout.tp, layout.pp, layout.vp, layout.cp, layout.dp, layout.ep
    mb = config.num_microbatches
    s, b = m.seq_length, config.train.micro_batch_size
    e = 2 if (m.bf16 or m.fp16) else 4
    t = s * b // cp
    h = m.hidden_size
    layers = max(p.layers for p in predictions)  # the busiest rank's
    recomputed = layers if layout.recompute == "selective" else 0
    if layout.recompute == "full":
        recomputed = min(layers, layout.recompute_layers * vp)
    full_recomputed = recomputed if layout.recompute == "full" else 0
    # TP (a node's NVLink: tp <= GPUS_PER_NODE)
    act = t * h * e
    if tp > 1:
        per_layer_fwd = 4 * _ring(tp, act) if layout.sp else 2 * 2 * _ring(tp, act)
        per_layer_bwd = 6 * _ring(tp, act) if layout.sp else 2 * 2 * _ring(tp, act)
        output = 2 * _ring(tp, act) if layout.sp else 2 * _ring(tp, act)
        loss = 3 * 2 * _ring(tp, t * 4)
        tp_bytes = mb * ((layers + full_recomputed) * per_layer_fwd + layers * per_layer_bwd + output + loss)
    else:
        tp_bytes = 0.0
    # CP: k and v gathered along the sequence
    g = (m.num_query_groups or m.num_attention_heads) // tp
    kv = b * g * s * m.kv_channels * e
    cp_bytes = (
        mb * 2 * ((layers + recomputed) * _ring(cp, kv) + layers * 2 * _ring(cp, kv)) if cp > 1 else 0.0
    )
    # PP: a middle rank's activations and gradients
    boundary = t * h * e // (tp if layout.sp else 1)
    pp_bytes = 4 * vp * mb * boundary if pp > 1 else 0.0
    # DP over dp x cp, once per step
    n = dp * cp
    grads = max(p.grads_bytes for p in predictions)
    weights = max(p.weights_bytes for p in predictions)
    dp_bytes = _ring(n, grads) + _ring(n, weights) if layout.distopt else 2 * _ring(n, grads)
    # EP: the routed rows' all-to-alls
    ep_bytes = 0.0
    if m.num_moe_experts and ep > 1:
        rows = t // (tp if layout.sp else 1) * m.moe_router_topk * h * e
        ep_bytes = mb * layers * 4 * _ring(ep, rows)
    comm = {"TP": tp_bytes, "CP": cp_bytes, "PP": pp_bytes, "DP": dp_bytes, "EP": ep_bytes}
    strides = {
        "TP": (1, tp),
        "CP": (tp, cp),
        "EP": (tp * cp, ep),
        "DP": (tp, cp * dp),
        "PP": (tp * cp * dp, pp),
    }
    inter = sum(comm[k] for k, (stride, size) in strides.items() if _crosses(stride, size))
    bubble = (pp - 1) / (vp * mb) if pp > 1 else 0.0
    return Figures(bubble, recompute_fraction(config, layout), comm, inter)


def describe_figures(f: Figures) -> str:
    """'bubble 0.6%, recompute +0.0% FLOPs; per GPU per step: TP 91 GB, ... (inter-node 12 GB)'."""
    comm = ", ".join(f"{k} {v / 1e9:.3g} GB" for k, v in f.comm_bytes.items() if v)
    return (
        f"bubble {f.bubble:.1%}, recompute +{f.recompute:.1%} FLOPs; sent+received per GPU per step: "
        f"{comm or 'nothing'} (across nodes {f.inter_node_bytes / 1e9:.3g} GB)"
    )
