"""The memory levers the preflight may pull, and what each costs: sequence parallelism, the
distributed optimizer, recompute (selective, or full over 1..N layers per chunk), moving layers from
the first stage to the last, deferring one microbatch's output-layer wgrad, the fused loss, a deeper
pipeline, for MoE models a larger expert-parallel size and a capacity factor and, for LoRA, the
adapters' sequence-parallel input regather and a smaller rank. ``candidate_changes`` lists every combination this layout can still pull, cheapest first: every
combination that keeps all tokens and the LoRA rank before any that drops tokens (a capacity factor),
those before any that lowers the rank, and within each by the extra step time."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts


@dataclass(frozen=True)
class Change:
    """A set of flags and its rough price in extra step time (a fraction: 0.25 = 25% slower) and in
    model quality (``quality``: 0 keeps every token; more drops more of them)."""

    flags: tuple[str, ...]
    cost: float
    why: str
    quality: int = 0
    quality_note: str = ""
    """What the quality cost is, said beside the recommendation (never silently)."""


def _recompute_changes(m, layers_per_chunk: int) -> list[Change]:
    """Selective recompute re-runs only core attention; full recompute of N of a chunk's layers re-runs
    their forward in backward (a forward is about a third of a step). Block recompute already on
    offers more of a chunk's layers at the price of the extra ones."""
    if m.recompute_granularity == "full" and m.recompute_method != "block":
        return []
    done = m.recompute_num_layers if m.recompute_granularity == "full" else 0
    changes = []
    if m.recompute_granularity is None:
        changes.append(Change(("--recompute-granularity", "selective"), 0.03, "recompute core attention"))
    for n in range(done + 1, layers_per_chunk + 1):
        flags = (
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "block",
            "--recompute-num-layers",
            str(n),
        )
        cost = 0.33 * (n - done) / layers_per_chunk
        changes.append(Change(flags, cost, f"recompute {n} layer(s) per chunk"))
    return changes


def _split_changes(m) -> list[Change]:
    """Move k layers from the first stage (the most microbatches in flight, and the embedding) to the
    last (the fewest): its weights, gradients, optimizer state and activations leave stage 0. The last
    stage then does k more layers of work per microbatch, and 1F1B runs at its slowest stage's pace."""
    pp = m.pipeline_model_parallel_size
    split_given = (
        m.num_layers_in_first_pipeline_stage is not None
        or m.num_layers_in_last_pipeline_stage is not None
        or m.account_for_embedding_in_pipeline_split
        or m.account_for_loss_in_pipeline_split
        or m.pipeline_model_parallel_layout is not None
    )
    if pp == 1 or split_given or m.num_layers % pp:  # only an even split of this depth is moved from
        return []
    n = m.num_layers // pp
    changes = []
    for k in range(1, n):
        flags = (
            "--decoder-first-pipeline-num-layers",
            str(n - k),
            "--decoder-last-pipeline-num-layers",
            str(n + k),
        )
        changes.append(Change(flags, k / n, f"{k} layer(s) moved from the first stage to the last"))
    return changes


def _expert_parallel_changes(config) -> list[Change]:
    """A larger --expert-model-parallel-size: fewer experts per rank, so their weights, gradients and
    (without the distributed optimizer) optimizer state shrink; the worst routing's rows per rank grow
    (more ranks may send every token here). Only sizes that divide the experts and whose etp x ep
    groups tile a stage's tp x cp x dp ranks (the same world: EP ranks come out of the DP ranks)."""
    m = config.model
    if not m.num_moe_experts:
        return []
    ep, experts = m.expert_model_parallel_size, m.num_moe_experts
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    per_stage = m.tensor_model_parallel_size * m.context_parallel_size * config.data_parallel_size
    # A wider all-to-all (across nodes, sooner) and smaller expert GEMMs: 5% per doubling, roughly.
    return [
        Change(
            ("--expert-model-parallel-size", str(new)),
            0.05 * math.log2(new / ep),
            f"expert parallel {new}: {experts // new} expert(s) per rank",
        )
        for new in range(ep + 1, experts + 1)
        if experts % new == 0 and per_stage % (etp * new) == 0
    ]


def _loss_fusion_changes(m) -> list[Change]:
    """--cross-entropy-loss-fusion: the last stage never holds its [s, b, V/tp] logits, their fp32
    copy or the softmax saved until backward; it pays one more output-layer GEMM (the logits again in
    backward), priced against the last stage's work per token: its layers' (24 h^2 / tp each, the
    attention's scores aside) and the output layer's three GEMMs (6 h V / tp)."""
    if m.cross_entropy_loss_fusion:
        return []
    tp, h = m.tensor_model_parallel_size, m.hidden_size
    vocab = m.padded_vocab_size // tp
    layers = sum(chunk[-1] for chunk in pipeline_layer_counts(m))  # the last rank's, over its chunks
    last = layers * 24 * h * h / tp + 6 * h * vocab
    why = "the output layer and loss over chunks of tokens: no [s, b, vocab/tp] logits"
    return [Change(("--cross-entropy-loss-fusion",), 2 * h * vocab / last, why)]


# Largest first: the least dropping is tried first.
CAPACITY_FACTORS = (1.5, 1.25, 1.0)


def _capacity_changes(m) -> list[Change]:
    """--moe-expert-capacity-factor with padding: every expert takes exactly its capacity of each
    rank's tokens, so the routed rows are fixed, whatever the routing. It drops the tokens routed past
    an expert's capacity (a cost in model quality, not time: the padded rows cost about what the
    busiest expert of skewed routing does), so it ranks after every change that keeps them all."""
    if not m.num_moe_experts or m.moe_expert_capacity_factor is not None:
        return []
    note = (
        "it drops the tokens routed past an expert's capacity, a cost in model quality: tried only "
        "after every change that keeps all tokens"
    )
    return [
        Change(
            ("--moe-expert-capacity-factor", str(cf), "--moe-pad-expert-input-to-capacity"),
            0.0,
            f"capacity factor {cf}, padded: each expert takes {cf}x its balanced share of a rank's tokens",
            quality=rank,
            quality_note=note,
        )
        for rank, cf in enumerate(CAPACITY_FACTORS, 1)
    ]


# A LoRA rank is not halved below this.
MIN_LORA_DIM = 4
# Past every capacity factor's quality rank: a smaller rank is the last lever tried.
_LORA_QUALITY = len(CAPACITY_FACTORS) + 1


def _lora_dim_changes(config) -> list[Change]:
    """LoRA: a smaller --lora-dim (halved, down to MIN_LORA_DIM, divisible by the tensor-parallel
    sizes its column-parallel adapters split it over): fewer adapter weights, gradients and optimizer
    state, and a smaller low-rank activation. It changes what the fine-tune can learn, so it is tried
    after every other lever and said so; --lora-alpha is kept (the update's scale alpha / dim grows)."""
    from megatron_lite.training.memory.predict.lora import lora_of

    lora = lora_of(config)
    if lora is None:
        return []
    m = config.model
    split = max(m.tensor_model_parallel_size, m.expert_tensor_parallel_size or 1)
    note = (
        "a lower LoRA rank adapts less, a cost in what the fine-tune can learn: tried only after every "
        "change that keeps the rank"
    )
    changes, dim = [], lora.dim // 2
    while dim >= MIN_LORA_DIM and dim % split == 0:
        halvings = (lora.dim // dim).bit_length() - 1
        why = f"LoRA rank {dim} instead of {lora.dim}"
        changes.append(Change(("--lora-dim", str(dim)), 0.0, why, _LORA_QUALITY + halvings, note))
        dim //= 2
    return changes


def _regather_change(config) -> Change | None:
    """LoRA under sequence parallelism at TP > 1: --lora-sequence-parallel-input-regather (Bridge's
    sequence_parallel_input_regather): linear_qkv's and linear_fc1's adapters keep their input split
    by sequence (1/tp of the gathered copy they keep otherwise) and gather it again in backward, one
    more all-gather per adapter (megatron-core overlaps it with the input-gradient GEMM). Same
    numbers: it ranks with the levers that cost time only, before any smaller rank."""
    from megatron_lite.training.memory.predict.lora import lora_of

    lora = lora_of(config)
    if lora is None or lora.sequence_parallel_input_regather or config.model.tensor_model_parallel_size == 1:
        return None
    why = "LoRA adapters keep their input split by sequence, re-gathered in backward"
    return Change(("--lora-sequence-parallel-input-regather",), 0.01, why)


def candidate_changes(config) -> list[Change]:
    """Every combination of the levers this layout can still pull, cheapest first."""
    m = config.model
    tp, pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
    vp = m.virtual_pipeline_model_parallel_size or 1
    sp = (
        [None]
        if m.sequence_parallel or tp == 1
        else [
            None,
            Change(("--sequence-parallel",), 0.0, "sequence parallel: norms and dropout split over tp"),
        ]
    )
    regather = _regather_change(config)
    if regather is not None:  # it acts under sequence parallelism only: with it, or with its proposal
        if m.sequence_parallel:
            sp = [None, regather]
        else:
            both = Change((*sp[1].flags, *regather.flags), regather.cost, f"{sp[1].why}; {regather.why}")
            sp.append(both)
    distributed = config.optimizer.use_distributed_optimizer or config.data_parallel_size == 1
    distopt = (
        [None]
        if distributed
        else [None, Change(("--use-distributed-optimizer",), 0.01, "optimizer state sharded over dp")]
    )
    recompute = [None, *_recompute_changes(m, max(map(max, pipeline_layer_counts(m))))]
    # The last stage's deferred output-layer wgrad buffers: keep one microbatch's, not all of them.
    deferral = [None]
    if m.defer_embedding_wgrad_compute and m.wgrad_deferral_limit != 1:
        why = "defer one microbatch's output-layer wgrad, not every one"
        deferral.append(Change(("--wgrad-deferral-limit", "1"), 0.02, why))
    # A deeper pipeline spreads weights and optimizer state over more GPUs: the dearest change.
    world = config.world_size
    slots = (
        m.num_layers
        + int(m.account_for_embedding_in_pipeline_split)
        + int(m.account_for_loss_in_pipeline_split)
    )
    deeper = [None] + [
        Change(
            ("--pipeline-model-parallel-size", str(pp * k), "--nproc-per-node", str(world * k)),
            float(k - 1),
            f"{k}x the GPUs",
        )
        for k in (2, 4)
        if slots % (pp * k * vp) == 0
    ]
    # Moving layers is a lever of this depth only: a deeper pipeline gets the split as given.
    split = [(None, None)] + [(c, None) for c in _split_changes(m)] + [(None, c) for c in deeper[1:]]
    expert = [None, *_expert_parallel_changes(config)]
    capacity = [None, *_capacity_changes(m)]
    fusion = [None, *_loss_fusion_changes(m)]
    rank = [None, *_lora_dim_changes(config)]
    combos = []
    for parts in itertools.product(fusion, deferral, sp, distopt, expert, recompute, split, capacity, rank):
        parts = [*parts[:-3], *parts[-3], *parts[-2:]]
        chosen = [c for c in parts if c is not None]
        if chosen:
            flags = tuple(f for c in chosen for f in c.flags)
            why = "; ".join(c.why for c in chosen)
            note = "; ".join(c.quality_note for c in chosen if c.quality_note)
            combos.append(
                Change(flags, sum(c.cost for c in chosen), why, sum(c.quality for c in chosen), note)
            )
    return sorted(combos, key=lambda c: (c.quality, c.cost, len(c.flags)))
