"""Predicted weight, gradient-buffer and optimizer-state bytes of one pipeline rank (a prediction).

Pure functions of the config: :func:`chunk_parameters` lists the parameters a model chunk builds, in
``module.parameters()`` order with this tensor-parallel rank's sizes; :func:`buffer_layout` lays them
out as DistributedDataParallel's buffers do (reversed, one bucket per buffer unless
``overlap_grad_reduce``, each bucket padded to a multiple of dp x cp under the distributed
optimizer, a tied embedding in its own bucket there); :func:`optimizer_state_bytes` counts AdamW's
two fp32 moments and its fp32 ``step`` scalar per parameter (per shard range under the distributed
optimizer, for data-parallel rank 0) plus fp32 master copies of non-fp32 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron_lite.training.memory.predict.lora import (
    COLUMN,
    Linear,
    adapter_parameters,
    dense_linears,
    expert_adapter_dim,
    is_adapted,
    lora_of,
    moe_linears,
)
from megatron_lite.training.memory.predict.moe import (
    expert_data_parallel_size,
    expert_sizes,
    is_moe,
    moe_mlp_parameters,
)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a rank holds it: name, elements, dims, and whether it is the tied embedding
    that the first and last stage both hold (its own bucket under the distributed optimizer)."""

    name: str
    numel: int
    ndim: int
    shared_embedding: bool = False
    expert: bool = False  # a routed expert's: in the expert buffer, sharded over expert data parallelism
    trainable: bool = True  # False: a base weight LoRA froze (no gradient buffer, no optimizer state)


def _norm(prefix: str, m) -> list[ParamSpec]:
    h = m.hidden_size
    specs = [ParamSpec(f"{prefix}.weight", h, 1)]
    if m.normalization == "LayerNorm":
        specs.append(ParamSpec(f"{prefix}.bias", h, 1))
    return specs


def _linear(prefix: str, rows: int, cols: int, bias: bool, bias_numel: int) -> list[ParamSpec]:
    specs = [ParamSpec(f"{prefix}.weight", rows * cols, 2)]
    return specs + ([ParamSpec(f"{prefix}.bias", bias_numel, 1)] if bias else [])


def _layer(prefix: str, m, index: int = 0) -> list[ParamSpec]:
    """One transformer layer (global index ``index``): column-parallel outputs and row-parallel inputs
    split over tp; norms and row-parallel biases whole; a MoE layer's mlp from predict/moe.py."""
    tp, h = m.tensor_model_parallel_size, m.hidden_size
    groups = m.num_query_groups or m.num_attention_heads
    query = m.kv_channels * m.num_attention_heads
    qkv = (query + 2 * m.kv_channels * groups) // tp
    fc1 = m.ffn_hidden_size * (2 if m.gated_linear_unit else 1) // tp
    bias, qkv_bias = m.add_bias_linear, m.add_bias_linear or m.add_qkv_bias
    specs = [
        *_norm(f"{prefix}.input_layernorm", m),
        *_linear(f"{prefix}.self_attention.linear_qkv", qkv, h, qkv_bias, qkv),
        *_linear(f"{prefix}.self_attention.linear_proj", h, query // tp, bias, h),
        *_norm(f"{prefix}.pre_mlp_layernorm", m),
    ]
    if is_moe(m, index):
        dense, experts = moe_mlp_parameters(f"{prefix}.mlp", m, ParamSpec)
        return specs + dense + [ParamSpec(p.name, p.numel, p.ndim, expert=True) for p in experts]
    return [
        *specs,
        *_linear(f"{prefix}.mlp.linear_fc1", fc1, h, bias, fc1),
        *_linear(f"{prefix}.mlp.linear_fc2", h, m.ffn_hidden_size // tp, bias, h),
    ]


def _with_adapters(specs: list[ParamSpec], m, index: int, local_prefix: str, lora) -> list[ParamSpec]:
    """LoRA: the layer's base parameters frozen, and each adapted linear's adapter (trainable) after
    its base's parameters, in the module's registration order."""
    local, etp, _ = expert_sizes(m) if m.num_moe_experts else (1, 1, 1)
    linears = dense_linears(m)[:2] + moe_linears(m, local, etp) if is_moe(m, index) else dense_linears(m)
    out = [_frozen(p) for p in specs]
    for linear in linears:
        if not is_adapted(lora, f"{local_prefix}.{linear.path}"):
            continue
        stem = f"{specs[0].name.rsplit('.input_layernorm', 1)[0]}.{linear.path}"
        # After the last of the base linear's own parameters (a grouped expert linear's: the last one).
        last = max((i for i, p in enumerate(out) if p.name.startswith(stem + ".")), default=len(out) - 1)
        grouped = linear.expert and m.moe_grouped_gemm
        stacked = local if grouped and not getattr(lora, "share_expert_adapters", True) else 1
        dim = expert_adapter_dim(lora, m, linear)
        out[last + 1 : last + 1] = adapter_parameters(stem, linear, dim, ParamSpec, stacked)
    return out


def chunk_bounds(m, pp_rank: int, vp_stage: int) -> tuple[bool, bool]:
    """(holds the embedding, holds the final norm and output layer) for chunk ``vp_stage`` of
    ``pp_rank``: chunk 0 of the first rank, the last chunk of the last rank."""
    vp = m.virtual_pipeline_model_parallel_size or 1
    pp = m.pipeline_model_parallel_size
    return vp_stage == 0 and pp_rank == 0, vp_stage == vp - 1 and pp_rank == pp - 1


def chunk_parameters(m, pp_rank: int, vp_stage: int, lora=None) -> list[ParamSpec]:
    """The parameters chunk ``vp_stage`` of pipeline rank ``pp_rank`` builds (``m`` a
    GPTModelProvider), in the model's registration order, with tensor-parallel rank 0's sizes; with
    ``lora`` (predict/lora/) the base frozen and the adapters added."""
    tp, h = m.tensor_model_parallel_size, m.hidden_size
    vocab = m.padded_vocab_size // tp
    pre, post = chunk_bounds(m, pp_rank, vp_stage)
    tied = m.share_embeddings_and_output_weights
    specs: list[ParamSpec] = []
    if pre:
        specs.append(ParamSpec("embedding.word_embeddings.weight", vocab * h, 2, tied and not post))
        if m.position_embedding_type == "learned_absolute":
            rows = m.max_position_embeddings or m.seq_length
            specs.append(ParamSpec("embedding.position_embeddings.weight", rows * h, 2))
    num_layers = get_num_layers_to_build(m, vp_stage, pp_rank)
    offset = get_transformer_layer_offset(m, vp_stage, pp_rank)
    for i in range(offset, offset + num_layers):
        layer = _layer(f"decoder.layers.{i}", m, i)
        # LoRA matches the chunk's own module path: its layers are numbered from 0.
        specs += _with_adapters(layer, m, i, f"decoder.layers.{i - offset}", lora) if lora else layer
    if post:
        specs += _norm("decoder.final_layernorm", m)
        if not (tied and pre):  # tied on one stage: the output layer reuses the embedding's weight
            specs.append(ParamSpec("output_layer.weight", vocab * h, 2, tied))
    if lora is None:
        return specs
    specs = [p if p.name.startswith("decoder.layers.") else _frozen(p) for p in specs]
    if post and is_adapted(lora, "output_layer"):
        out = Linear("output_layer", COLUMN, h, m.padded_vocab_size, tp)
        specs += adapter_parameters("output_layer", out, lora.dim, ParamSpec)
    return specs


def _frozen(p: ParamSpec) -> ParamSpec:
    return ParamSpec(p.name, p.numel, p.ndim, p.shared_embedding, p.expert, trainable=False)


@dataclass(frozen=True)
class Bucket:
    """A bucket of a gradient buffer: its parameters (buffer order), start, used and padded size."""

    params: tuple[ParamSpec, ...]
    start: int
    numel: int
    padded: int


def _bucket_size(config) -> int | None:
    ddp = config.ddp
    if not ddp.overlap_grad_reduce:
        return None  # one bucket per buffer, as DistributedDataParallel does without overlap
    return ddp.bucket_size or max(40_000_000, 1_000_000 * _dp_cp(config))


def _dp_cp(config) -> int:
    return config.data_parallel_size * config.model.context_parallel_size


def buffer_layout(specs: list[ParamSpec], config, dp: int | None = None) -> list[Bucket]:
    """The buckets of the one gradient buffer ``specs`` (all of one dtype and kind) fill, padded for
    ``dp`` ranks (dp x cp by default; the expert data-parallel size for the routed experts')."""
    distributed = config.optimizer.use_distributed_optimizer
    dp, bucket_size = dp or _dp_cp(config), _bucket_size(config)
    buckets: list[Bucket] = []
    current: list[ParamSpec] = []
    start = offset = 0
    for p in reversed(specs):
        own = distributed and p.shared_embedding
        if own and current:
            buckets.append(_close(current, start, offset, dp, distributed))
            current, start = [], buckets[-1].start + buckets[-1].padded
            offset = start
        current.append(p)
        offset += p.numel
        if own or (bucket_size is not None and offset - start >= bucket_size):
            buckets.append(_close(current, start, offset, dp, distributed))
            current, start = [], buckets[-1].start + buckets[-1].padded
            offset = start
    if current:
        buckets.append(_close(current, start, offset, dp, distributed))
    return buckets


def _close(params, start, offset, dp, distributed) -> Bucket:
    numel = offset - start
    padded = -(-numel // dp) * dp if distributed else numel
    return Bucket(tuple(params), start, numel, padded)


def shard_ranges(buckets: list[Bucket], dp: int, dp_rank: int = 0) -> list[int]:
    """Element counts of the parameter pieces in ``dp_rank``'s shard of every bucket (the distributed
    optimizer's ranges: one AdamW parameter each)."""
    ranges = []
    for bucket in buckets:
        size = bucket.padded // dp
        lo = bucket.start + dp_rank * size
        hi, begin = lo + size, bucket.start
        for p in bucket.params:
            a, b = max(begin, lo), min(begin + p.numel, hi)
            if a < b:
                ranges.append(b - a)
            begin += p.numel
    return ranges


def _dtype_bytes(m) -> int:
    return 2 if (m.bf16 or m.fp16) else 4


def param_memory(config, pp_rank: int, dp_rank: int = 0) -> dict[str, int]:
    """``weights_bytes``, ``grads_bytes`` (fp32 DDP buffers, padding included) and
    ``optimizer_state_bytes`` of one tensor-parallel rank of stage ``pp_rank`` (and, for the
    distributed optimizer's shard, rank ``dp_rank`` of dp x cp), summed over its chunks, plus
    ``parameters`` (their element count) and, for the optimizer step's scratch, ``largest_piece`` and
    ``total_pieces`` (elements of the largest and of all the parameters or shard pieces AdamW updates)
    and ``cloned_grads`` (elements whose fp32 gradient the plain optimizer copies for bf16 masters);
    with LoRA ``adapter_weights_bytes`` (the trainable adapters' share of the weights: the gradient
    buffers and optimizer state are theirs alone)."""
    m = config.model
    vp = m.virtual_pipeline_model_parallel_size or 1
    low_precision = _dtype_bytes(m) != 4
    weights = grads = optimizer = params = largest = total = adapters = 0
    lora = lora_of(config)
    for vp_stage in range(vp):
        specs = chunk_parameters(m, pp_rank, vp_stage, lora)
        params += sum(p.numel for p in specs)
        weights += sum(p.numel for p in specs) * _dtype_bytes(m)
        adapters += sum(p.numel for p in specs if p.trainable) * _dtype_bytes(m) if lora else 0
        pieces = []
        # DDP's buffers (trainable parameters only: LoRA's frozen base has none): the dense
        # parameters', then (MoE) the routed experts' over expert-dp.
        for expert in (False, True):
            kind = [p for p in specs if p.expert == expert and p.trainable]
            if not kind:
                continue
            dp = expert_data_parallel_size(config) if expert else _dp_cp(config)
            buckets = buffer_layout(kind, config, dp)
            grads += sum(b.padded for b in buckets) * 4
            if config.optimizer.use_distributed_optimizer:
                pieces += shard_ranges(buckets, dp, dp_rank % dp)
            else:
                pieces += [p.numel for p in kind]
        # exp_avg and exp_avg_sq in fp32, a 4-byte ``step`` tensor, and an fp32 master if needed.
        optimizer += sum(8 * n + 4 + (4 * n if low_precision else 0) for n in pieces)
        largest, total = max([largest, *pieces]), total + sum(pieces)
    distributed = config.optimizer.use_distributed_optimizer
    return {
        "largest_piece": largest,
        "total_pieces": total,
        "cloned_grads": total if low_precision and not distributed else 0,
        "parameters": params,
        "weights_bytes": weights,
        "grads_bytes": grads,
        "optimizer_state_bytes": optimizer,
        "adapter_weights_bytes": adapters,
    }
