"""What a layer saves with LoRA's frozen base and adapters, and linear_fc2's backward with them (see
the package docstring; measured op by op on CPU: test_lora_memory.py)."""

from __future__ import annotations

from megatron_lite.training.memory.predict.lora.targets import (
    COLUMN,
    ROW,
    Linear,
    dense_linears,
    is_adapted,
    moe_linears,
)

# A dense layer's adapted linear -> the saved storage that is its input (forward order).
_INPUTS = {
    "self_attention.linear_qkv": "linear_qkv.input",
    "self_attention.linear_proj": "linear_proj.input",
    "mlp.linear_fc1": "linear_fc1.input",
    "mlp.linear_fc2": "linear_fc2.input",
}
# Inputs only a trainable base weight keeps (a frozen one's input is saved only by its adapter).
_FROZEN_DROPS = ("linear_qkv.input", "linear_fc1.input", "linear_fc2.input")


def dropout_mask_bytes(x) -> int:
    """Bytes per element of the mask an adapter's dropout (``nn.Dropout``) keeps: CUDA's fused kernel
    keeps a bool mask; the CPU's keeps its scaled noise in the input's dtype."""
    return 1 if x.device == "cuda" else x.elt


def _adapter_saves(
    x, linear: Linear, shared: bool, input_bytes: int, grad_input: bool = True, rows: float | None = None
) -> dict[str, int]:
    """What one adapter saves beyond the storages the layer already keeps: its input (``input_bytes``,
    the base's input storage, counted unless ``shared``: already saved), the low-rank t r e, and
    with dropout its mask and, "pre", the dropped copy it reads. ``grad_input``: whether its input
    requires a gradient (the pre-dropout's mask is kept only then); ``rows``: the tokens it sees
    (a routed expert's: the rows the rank's experts take), t by default."""
    m, lora, e = x.m, x.lora, x.elt
    rows = x.tokens if rows is None else rows
    # Under SP a column-parallel adapter keeps its gathered input; with Bridge's regather
    # (peft/parallel_adapter.py, at TP > 1) it keeps the sequence slice it was given, as without SP.
    regather = getattr(lora, "sequence_parallel_input_regather", False) and linear.tp > 1
    sp = m.sequence_parallel and linear.kind == COLUMN and not linear.expert and not regather
    out: dict[str, int] = {}
    dropout = getattr(lora, "dropout", 0.0) or 0.0
    pre = getattr(lora, "dropout_position", "pre") == "pre"
    mask = dropout_mask_bytes(x)
    if dropout > 0 and pre:
        if grad_input:
            out[f"{linear.path}.adapter.dropout.mask"] = input_bytes // e * mask
        if not sp:  # the dropped copy is linear_in's input (under SP the gathered copy, below)
            out[f"{linear.path}.adapter.input"] = input_bytes
    if sp:  # linear_in's input: the whole sequence, gathered
        out[f"{linear.path}.adapter.input"] = x.tokens * linear.in_features * e
    elif not (dropout > 0 and pre):
        out[f"{linear.path}.adapter.input"] = 0 if shared else input_bytes
    # linear_out's input: the low-rank activation, whole over TP (gathered, or all-reduced).
    out[f"{linear.path}.adapter.low_rank"] = rows * lora.dim * e
    if dropout > 0 and not pre:
        # The output's mask: a column base's columns of every token, a row base's whole output of
        # this rank's tokens (split by sequence under SP).
        if linear.kind == COLUMN or linear.expert:
            out[f"{linear.path}.adapter.dropout.mask"] = rows * linear.out_features // linear.tp * mask
        else:
            out[f"{linear.path}.adapter.dropout.mask"] = x.norm_tokens * linear.out_features * mask
    return out


def lora_layer_saves(x, saves: dict[str, int], local_index: int, grad_in: bool = True, moe: bool = False):
    """``saves`` (a layer's, activations.layer_saves, forward order) with LoRA: (the saves, whether
    the layer's output requires a gradient). ``local_index``: the layer's index in its chunk (what
    target patterns match); ``grad_in``: whether its input requires a gradient (not on the first
    stage before the first adapter)."""
    m, lora = x.m, x.lora
    e, h = x.elt, m.hidden_size
    linears = dense_linears(m)[:2] if moe else dense_linears(m)
    adapted = [n for n in linears if is_adapted(lora, f"decoder.layers.{local_index}.{n.path}")]
    # Shared input sizes: what the base's input storage holds on this rank.
    sizes = {
        "self_attention.linear_qkv": x.norm_tokens * h * e,
        "self_attention.linear_proj": saves.get("core_attention.output", saves.get("linear_proj.input", 0)),
        "mlp.linear_fc1": x.norm_tokens * h * e,
        "mlp.linear_fc2": saves.get("linear_fc2.input", 0),
    }
    out = dict(saves)
    for key in (*_FROZEN_DROPS, "linear_proj.input"):  # the math path's copy; flash keeps its output
        out.pop(key, None)
    routed = moe and any(
        is_adapted(lora, f"decoder.layers.{local_index}.{n.path}") for n in moe_linears(m, *_local_and_etp(m))
    )
    if not grad_in:
        if not adapted and not routed:
            return {}, False
        if not adapted:  # a MoE MLP's adapters come first: the attention's saves are not made (the
            # MLP's are counted as with an input that needs a gradient: an upper bound, not measured)
            keys = list(saves)
            before = set(keys[: keys.index("pre_mlp_layernorm.input")])
            return {
                **{k: v for k, v in out.items() if k not in before},
                **_moe_adapter_saves(x, saves, local_index),
            }, True
        # Nothing before the first adapter requires a gradient: its saves are not made.
        keys = list(saves)
        first = adapted[0].path
        if first == "self_attention.linear_proj":  # the attention's saves go, its output too
            mlp = keys.index("pre_mlp_layernorm.input")
            before = {k for k in keys[:mlp] if k != "attention.dropout.mask"}
        else:
            before = set(keys[: keys.index(_INPUTS[first])])
        out = {k: v for k, v in out.items() if k not in before}
    if moe:
        out.update(_moe_adapter_saves(x, saves, local_index))
    for i, linear in enumerate(adapted):
        key = _INPUTS[linear.path]
        if key == "linear_proj.input" and "core_attention.output" in saves:
            key = "core_attention.output"
        grad_input = grad_in or i > 0  # the first adapter reads what needs no gradient
        out.update(_adapter_saves(x, linear, key in out, sizes[linear.path], grad_input))
    return out, True


def output_adapter_saves(x) -> dict[str, int]:
    """The output layer's adapter (when LoRA targets ``output_layer``): as a column-parallel linear's."""
    m = x.m
    if not is_adapted(x.lora, "output_layer"):
        return {}
    linear = Linear("output_layer", COLUMN, m.hidden_size, m.padded_vocab_size, m.tensor_model_parallel_size)
    return _adapter_saves(x, linear, False, x.norm_tokens * m.hidden_size * x.elt)


def _dense_fc2_adapted(x) -> bool:
    """Whether some dense layer's linear_fc2 carries an adapter (a MoE layer has none of its own)."""
    from megatron_lite.training.memory.predict.moe import is_moe

    m = x.m
    if all(is_moe(m, i) for i in range(m.num_layers)):
        return False
    return any(is_adapted(x.lora, f"decoder.layers.{i}.mlp.linear_fc2") for i in range(_max_local_layers(m)))


def experts_fc2_adapted(x) -> bool:
    """Whether some MoE layer's routed experts' fc2 carries an adapter."""
    m = x.m
    return bool(m.num_moe_experts) and any(
        is_adapted(x.lora, f"decoder.layers.{i}.mlp.experts.linear_fc2") for i in range(_max_local_layers(m))
    )


def lora_fc2_backward_extra(x, f: int) -> int:
    """A LoRA layer's linear_fc2 backward beyond its output gradient, its largest instant (measured on
    CPU): the frozen base gives the input gradient t f e and no weight gradient; with an adapter,
    the adapter's input gradient t f e too and the two are added into a third (autograd's
    accumulation), beside the adapter's scaled output gradient (gathered under SP) and its low-rank
    gradients."""
    m, t, e, h = x.m, x.tokens, x.elt, x.m.hidden_size
    if not _dense_fc2_adapted(x):
        return t * f * e
    scaled = x.norm_tokens * h * e + (t * h * e if m.sequence_parallel else 0)
    return 3 * t * f * e + scaled + 2 * t * x.lora.dim * e


def lora_fc2_released(x) -> int:
    """What linear_fc2's adapter saved and released by the instant of its layer's backward peak: a
    dense layer's its input (which the frozen base does not keep) and low-rank activation; the
    routed experts' their rows' input and low-rank rows (the grouped GEMM of frozen experts keeps no
    input: core/transformer/moe/experts.py GroupedLinear)."""
    m = x.m
    if _dense_fc2_adapted(x):
        f = m.ffn_hidden_size // m.tensor_model_parallel_size
        return x.tokens * (f + x.lora.dim) * x.elt
    if experts_fc2_adapted(x) and m.moe_grouped_gemm:
        from megatron_lite.training.memory.predict.moe import routed_rows

        f = m.moe_ffn_hidden_size // _local_and_etp(m)[1]
        return round(routed_rows(m, x.norm_tokens, x.routing)[0] * (f + x.lora.dim) * x.elt)
    return 0


def _max_local_layers(m) -> int:
    """An upper bound on a chunk's layer count (target patterns match chunk-local indices)."""
    return max(1, m.num_layers)


def _local_and_etp(m) -> tuple[int, int]:
    from megatron_lite.training.memory.predict.moe import expert_sizes

    local, etp, _ = expert_sizes(m)
    return local, etp


def _moe_adapter_saves(x, saves: dict[str, int], local_index: int) -> dict[str, int]:
    """A MoE layer's MLP under LoRA (measured on CPU against a bare MoE layer): the frozen router keeps
    no input and the frozen grouped bias add no row-to-expert index; a routed expert's adapter reads
    rows its base layer's input already holds (the dispatched rows, fc2's input) and keeps its low-rank
    activation R r e; the shared expert's adapters are a dense MLP's (fc1's reads the layer's input).
    A routed linear without an adapter is counted as a trainable one's saves (an upper bound)."""
    from megatron_lite.training.memory.predict.moe import expert_sizes, routed_rows

    m = x.m
    local, etp, _ = expert_sizes(m)
    rows, _ = routed_rows(m, x.norm_tokens, x.routing)
    out: dict[str, int] = {}
    if "experts.bias" in saves:
        out["experts.bias"] = saves["experts.bias"] - rows * 16
    for linear in moe_linears(m, local, etp):
        if not is_adapted(x.lora, f"decoder.layers.{local_index}.{linear.path}"):
            continue
        if linear.expert:
            # A grouped linear's adapter sees all the rows; a sequential expert's its own share.
            part = rows if m.moe_grouped_gemm else rows / local
            width = linear.in_features // (linear.tp if linear.kind == ROW else 1)
            out.update(_adapter_saves(x, linear, True, part * width * x.elt, True, part))
        elif linear.path.endswith("linear_fc1"):
            out.update(_adapter_saves(x, linear, False, x.norm_tokens * m.hidden_size * x.elt))
        else:
            out.update(_adapter_saves(x, linear, True, 0))
    return out
