"""LoRA under tensor, sequence and expert parallelism computes what one process computes (Megatron-Bridge's
adapter layout): in one two-rank gloo world, a LoRA GPT at TP 2 (with and without sequence
parallelism) and a LoRA MoE layer at EP 2 and at expert TP 2 give the one-process outputs, input
gradients and adapter gradients (each rank's slice of them), starting from the same full weights;
folding the adapters into the weights there (merge_lora_model, collective) keeps the outputs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_helpers import run_world

from megatron_lite.core import parallel_state
from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.transformer.moe.moe_layer import MoELayer
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import seeded_init
from megatron_lite.peft import LoRA, LoRALinear
from megatron_lite.peft.lora_merge import merge_lora_model

pytestmark = pytest.mark.world

SEQ, VOCAB, H = 16, 128, 16
MOE_VARIANTS = [(False, True), (True, True), (True, False)]  # (grouped GEMM, shared expert adapters)


def _lora(**fields) -> LoRA:
    # B drawn non-zero so the adapters change outputs and every adapter weight gets a gradient.
    return LoRA(dim=4, alpha=8, lora_B_init_method="normal", **fields)


def _local_part(full: torch.Tensor, param, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of a full tensor, as the parameter's TP attributes place it."""
    if size == 1 or not getattr(param, "tensor_model_parallel", False):
        return full
    dim, stride = param.partition_dim, param.partition_stride
    blocks = full.chunk(stride * size, dim=dim)
    return torch.cat([blocks[rank + j * size] for j in range(stride)], dim=dim)


def _adapter_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _gpt(tp_size: int, sp: bool, pg, regather: bool = False) -> GPTModel:
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, gated_linear_unit=True, activation_func=F.silu,
        tensor_model_parallel_size=tp_size, sequence_parallel=sp,
    )  # fmt: skip
    torch.manual_seed(0)
    return _lora(sequence_parallel_input_regather=regather)(GPTModel(config, VOCAB, SEQ, pg_collection=pg))


def _check_adapter_pieces(model, rank: int, world: int) -> None:
    """The adapters' checkpoint pieces: this rank's slice at its place in the full tensor; a gated
    linear_fc1's linear_out as its gate rows then its up rows (as the base's)."""
    layer = model.decoder.layers[0]
    qkv = layer.self_attention.linear_qkv.sharded_state_dict("q.")
    assert qkv["q.weight"].global_shape == (96, 32)  # the base's keys as the unwrapped layer's
    a, b = qkv["q.adapter.linear_in.weight"], qkv["q.adapter.linear_out.weight"]
    assert (a.global_shape, a.global_offset, b.global_shape, b.global_offset) == (
        (4, 32),
        (2 * rank, 0),
        (96, 4),
        (48 * rank, 0),
    )
    proj = layer.self_attention.linear_proj.sharded_state_dict("p.")["p.adapter.linear_in.weight"]
    assert (proj.global_shape, proj.global_offset) == ((4, 32), (0, 16 * rank))
    fc1 = layer.mlp.linear_fc1.sharded_state_dict("f.")["f.adapter.linear_out.weight"].build()
    ffn = 4 * 32
    assert [(p.global_shape, p.global_offset) for p in fc1] == [
        ((2 * ffn, 4), (ffn // 2 * rank, 0)),
        ((2 * ffn, 4), (ffn + ffn // 2 * rank, 0)),
    ]


def _check_expert_adapter_pieces(layer, ep: int, etp: int, offset: int, etp_rank: int) -> None:
    """One adapter per expert: its checkpoint pieces sit at this rank's experts of the global expert
    axis, a gated fc1's linear_out as [gate; up] rows split over expert TP."""
    pieces = layer.experts.linear_fc1.sharded_state_dict("e.")
    a = pieces["e.adapter.linear_in.weight"]
    a = a.build() if hasattr(a, "build") else [a]
    assert [(p.global_shape, p.global_offset) for p in a] == [((4, 4, H), (offset, etp_rank * 4 // etp, 0))]
    b = pieces["e.adapter.linear_out.weight"]
    b = b.build() if hasattr(b, "build") else [b]
    rows = 32 // etp  # of the gate (and of the up projection) per expert-TP rank
    expected = [((4, 64, 4), (offset, etp_rank * rows, 0))]
    if etp > 1:
        expected = [((4, 64, 4), (offset, j * 32 + etp_rank * rows, 0)) for j in range(2)]
    assert [(p.global_shape, p.global_offset) for p in b] == expected, [
        (p.global_shape, p.global_offset) for p in b
    ]


def _regather_errors(model, loss, grads, pg) -> dict:
    """The TP 2 + SP model with linear_in's input kept split by sequence and gathered again in
    backward: its loss and adapter gradients are the standard path's (``model``'s), within 1e-6."""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions, labels = torch.arange(SEQ).expand_as(tokens), torch.roll(tokens, -1, dims=1)
    regather = _gpt(dist.get_world_size(pg.tp), True, pg, regather=True)
    adapters = [m.adapter for m in regather.modules() if isinstance(m, LoRALinear)]
    assert sum(a.regathers_input for a in adapters) == 4  # linear_qkv and linear_fc1 of both layers
    regather_loss = regather(tokens, positions, labels=labels).mean()
    regather_loss.backward()
    errors = {"tp2 sp regather loss": abs(regather_loss.item() - loss.item())}
    for name, grad in _adapter_grads(regather).items():
        errors[f"tp2 sp regather {name}"] = (
            (grad - grads[name]).abs().max() / grads[name].abs().max()
        ).item()
    return errors


def _gpt_errors(rank: int, world: int) -> dict:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    positions, labels = torch.arange(SEQ).expand_as(tokens), torch.roll(tokens, -1, dims=1)
    ref = _gpt(1, False, ProcessGroupCollection())
    ref_loss = ref(tokens, positions, labels=labels).mean()
    ref_loss.backward()
    ref_grads = _adapter_grads(ref)
    tp = dist.new_group(list(range(world)))
    errors = {}
    for sp in (False, True):
        model = _gpt(world, sp, ProcessGroupCollection(tp=tp))
        loss = model(tokens, positions, labels=labels).mean()
        loss.backward()
        errors[f"tp2 sp={sp} loss"] = abs(loss.item() - ref_loss.item())
        params = dict(model.named_parameters())
        grads = _adapter_grads(model)
        assert len(grads) == 16 and set(grads) == set(ref_grads)
        for name, grad in grads.items():
            expected = _local_part(ref_grads[name], params[name], rank, world)
            errors[f"tp2 sp={sp} {name}"] = ((grad - expected).abs().max() / expected.abs().max()).item()
        if not sp:
            _check_adapter_pieces(model, rank, world)
        else:  # Bridge's sequence_parallel_input_regather: the standard path's numbers
            errors.update(_regather_errors(model, loss, grads, pg=ProcessGroupCollection(tp=tp)))
        # Folding the adapters in (collective over TP) leaves the logits as they are.
        model.eval()
        with torch.no_grad():
            lora_logits = model(tokens, positions)
            merge_lora_model([model])
            assert not any(isinstance(m, LoRALinear) for m in model.modules())
            merged = model(tokens, positions)
        errors[f"tp2 sp={sp} merged logits"] = (
            (merged - lora_logits).abs().max() / lora_logits.abs().max()
        ).item()
    return errors


def _moe(grouped: bool, shared: bool, pg, **overrides) -> MoELayer:
    config = TransformerConfig(
        num_layers=1, hidden_size=H, num_attention_heads=2, ffn_hidden_size=32, num_moe_experts=4,
        moe_router_topk=2, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        moe_shared_expert_intermediate_size=16, moe_grouped_gemm=grouped, **overrides,
    )  # fmt: skip
    with seeded_init(7, "layer 0"):
        layer = MoELayer(
            config, layer_number=1, pg_collection=pg, seed=7,
            init_method=config.init_method, output_layer_init_method=config.output_layer_init_method,
        )  # fmt: skip
    return _lora(share_expert_adapters=shared)(layer)


def _moe_reference(grouped: bool, shared: bool):
    torch.manual_seed(0)
    hidden = torch.randn(8, 4, H, requires_grad=True)
    weights = torch.randn(8, 4, H)
    layer = _moe(grouped, shared, ProcessGroupCollection())
    out = layer(hidden)
    (out * weights).sum().backward()
    return hidden.detach(), weights, out.detach(), hidden.grad.clone(), _adapter_grads(layer)


def _reference_name(name: str, offset: int) -> str:
    if ".local_experts." not in name:
        return name
    head, rest = name.split(".local_experts.")
    index, tail = rest.split(".", 1)
    return f"{head}.local_experts.{int(index) + offset}.{tail}"


def _moe_errors(tp: int, ep: int, etp: int, references: dict) -> dict:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
    )
    errors = {}
    try:
        dp_rank, dp = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        etp_rank = parallel_state.get_expert_tensor_parallel_rank()
        offset = parallel_state.get_expert_model_parallel_rank() * (4 // ep)
        part = lambda t: t.chunk(dp, dim=1)[dp_rank].chunk(tp, dim=0)[tp_rank]  # noqa: E731
        for (grouped, shared), (hidden, weights, ref_out, ref_hidden_grad, ref_grads) in references.items():
            case = f"tp{tp} ep{ep} etp{etp} grouped={grouped} shared={shared}"
            layer = _moe(
                grouped, shared, ProcessGroupCollection.use_mpu_process_groups(),
                tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
            )  # fmt: skip
            x = part(hidden).clone().requires_grad_(True)
            out = layer(x)
            (out * part(weights)).sum().backward()
            errors[f"{case} out"] = (out - part(ref_out)).abs().max().item()
            errors[f"{case} input grad"] = (x.grad - part(ref_hidden_grad)).abs().max().item()
            params = dict(layer.named_parameters())
            for name, grad in _adapter_grads(layer).items():
                expert = not params[name].allreduce
                group = (
                    parallel_state.get_expert_data_parallel_group()
                    if expert
                    else parallel_state.get_data_parallel_group()
                )
                dist.all_reduce(grad, group=group)  # what DDP sums: each replica saw other tokens
                full = ref_grads[_reference_name(name, offset)]
                if grouped and not shared and name.startswith("experts."):
                    full = full[offset : offset + 4 // ep]  # this rank's experts of the stacked axis
                rank, size = (etp_rank, etp) if expert else (tp_rank, tp)
                expected = _local_part(full, params[name], rank, size)
                errors[f"{case} {name}"] = ((grad - expected).abs().max() / expected.abs().max()).item()
            if grouped and not shared:
                _check_expert_adapter_pieces(layer, ep, etp, offset, etp_rank)
            if grouped and shared:  # the same adapter on every expert-parallel rank: rank 0's is written
                piece = layer.experts.linear_fc1.sharded_state_dict("e.")["e.adapter.linear_in.weight"]
                assert piece.replica_id == (0, 0, parallel_state.get_expert_model_parallel_rank())
            with torch.no_grad():
                merge_lora_model(layer)
                errors[f"{case} merged out"] = (layer(x) - out).abs().max().item()
    finally:
        parallel_state.destroy_model_parallel()
    return errors


def _all_cases(rank: int, world: int) -> dict:
    references = {variant: _moe_reference(*variant) for variant in MOE_VARIANTS}
    errors = _gpt_errors(rank, world)
    errors.update(_moe_errors(1, 2, 1, references))
    errors.update(_moe_errors(2, 1, 2, references))
    return errors


def test_lora_at_tp_sp_ep_and_expert_tp_matches_one_process():
    for errors in run_world(_all_cases, 2):
        assert len(errors) > 60
        bad = {k: v for k, v in errors.items() if not v <= (1e-6 if "regather" in k else 1e-5)}
        assert bad == {}
