"""LoRA's memory: frozen base weights keep their weights but no gradients, masters or optimizer state;
the adapters' parameters, gradients and state; what a layer saves with frozen linears and adapters
(to the byte); and each stage's predicted allocated peak against real LoRA runs at four layouts."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import ok, run_pretrain
from memory_measure import measure

from megatron_lite.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron_lite.core.transformer.transformer_layer import TransformerLayer
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.peft import LoRA
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.memory.predict.activations import Shape, layer_saves
from megatron_lite.training.memory.predict.params import chunk_parameters
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage
from megatron_lite.training.memory.saved_tensors import ActivationMemoryTracker

GPT = dict(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, kv_channels=16)
LLAMA = dict(
    GPT, ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
    activation_func=torch.nn.functional.silu, num_query_groups=2, add_bias_linear=False,
    position_embedding_type="rope",
)  # fmt: skip
ALL = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
# name -> (architecture, LoRA's fields)
LAYERS = {
    "gpt": (GPT, dict(target_modules=ALL)),
    "llama": (LLAMA, dict(target_modules=ALL)),
    "llama-dropout-pre": (LLAMA, dict(target_modules=ALL, dropout=0.1)),
    "gpt-dropout-post": (GPT, dict(target_modules=ALL, dropout=0.1, dropout_position="post")),
    "gpt-qkv-only": (GPT, dict(target_modules=["linear_qkv"])),
    "llama-proj-fc2": (LLAMA, dict(target_modules=["linear_proj", "linear_fc2"])),
    "llama-bf16": (dict(LLAMA, bf16=True, params_dtype=torch.bfloat16), dict(target_modules=ALL)),
}


@pytest.mark.parametrize("grad_in", [True, False], ids=["input-needs-grad", "first-stage-input"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_one_lora_layer_saves_what_the_count_says(name, grad_in):
    """A bare layer with LoRA applied saves exactly the storages the count gives: frozen linears keep
    no input, adapters keep theirs and the low-rank activation; on the first stage (an input needing
    no gradient) nothing before the first adapter is saved."""
    arch, fields = LAYERS[name]
    model_parallel_cuda_manual_seed(1234)
    m = GPTModelProvider(**arch, vocab_size=32, seq_length=64, use_cpu_initialization=True)
    lora = LoRA(dim=8, alpha=16, **fields)
    s, b = 64, 2
    layer = TransformerLayer(
        m, 1, init_method=m.init_method, output_layer_init_method=m.output_layer_init_method
    )
    layer = lora(layer, training=True)
    tracker = ActivationMemoryTracker()
    tracker.exclude_parameters(layer.parameters())
    x = torch.randn(s, b, m.hidden_size, dtype=m.params_dtype, requires_grad=grad_in)
    rope = RotaryEmbedding(m.kv_channels, 1.0)(s) if m.position_embedding_type == "rope" else None
    with tracker.track():
        out = layer(x, rope)
    elt = 2 if m.bf16 else 4
    shape = Shape(s * b, s * b, s, s, b, elt, m, lora=lora)
    assert tracker.current_bytes == sum(layer_saves(shape, grad_in=grad_in).values())
    out.float().sum().backward()
    assert tracker.current_bytes == 0


def _lora_model(lora=None, **fields):
    model_parallel_cuda_manual_seed(1234)
    m = GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
        max_position_embeddings=32, use_cpu_initialization=True, **fields,
    )  # fmt: skip
    m._pg_collection = ProcessGroupCollection()  # one process: no groups
    lora = lora or LoRA(dim=8, alpha=16)
    return m, lora, lora(m.provide(pre_process=True, post_process=True), training=True)


@pytest.mark.parametrize(
    "targets, excluded",
    [
        ([], ["linear_fc2"]),
        (["*.layers.1.*.linear_qkv", "linear_fc1"], []),
        (["linear_qkv", "output_layer"], []),
    ],
    ids=["all-linears-but-fc2", "wildcard-and-name", "output-layer"],
)
def test_the_counted_adapters_follow_bridges_target_and_exclude_matching(targets, excluded):
    lora = LoRA(dim=8, target_modules=targets, exclude_modules=excluded)
    m, lora, model = _lora_model(lora, share_embeddings_and_output_weights=False)
    built = [(n.replace(".to_wrap.", "."), p.numel(), p.requires_grad) for n, p in model.named_parameters()]
    assert [(p.name, p.numel, p.trainable) for p in chunk_parameters(m, 0, 0, lora)] == built


MOE_MODEL = dict(
    num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_shared_expert_intermediate_size=32,
    moe_token_dispatcher_type="alltoall",
)  # fmt: skip


@pytest.mark.parametrize(
    "fields",
    [
        dict(share_embeddings_and_output_weights=True),
        dict(share_embeddings_and_output_weights=False),
        MOE_MODEL,
    ],
    ids=["tied", "untied", "moe"],
)
def test_the_counted_parameters_are_the_lora_models_frozen_and_trainable_ones(fields):
    m, lora, model = _lora_model(**fields)
    built = [(n.replace(".to_wrap.", "."), p.numel(), p.requires_grad) for n, p in model.named_parameters()]
    counted = [(p.name, p.numel, p.trainable) for p in chunk_parameters(m, 0, 0, lora)]
    if m.num_moe_experts:  # routed experts and dense parameters fill buffers of their own: order aside
        assert sorted(counted) == sorted(built)
        return
    assert counted == built
    assert {n for n, _, trainable in built if trainable} == {
        f"decoder.layers.{i}.{module}.adapter.{part}.weight"
        for i in range(2)
        for module in (
            "self_attention.linear_qkv",
            "self_attention.linear_proj",
            "mlp.linear_fc1",
            "mlp.linear_fc2",
        )
        for part in ("linear_in", "linear_out")
    }


MODEL = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--vocab-size 256 --micro-batch-size 2 --train-iters 2 --log-interval 1 --lr 1e-3 "
    "--untie-embeddings-and-output-weights"
).split()
LORA = ["--peft", "lora", "--lora-dim", "8", "--lora-alpha", "16"]


def _config(*extra: str):
    return parse_args([*MODEL, "--global-batch-size", "8", *extra])


def test_frozen_weights_keep_their_bytes_and_lose_gradients_and_optimizer_state(tmp_path):
    full = predict_memory_per_stage(_config("--bf16"))[0]
    lora = predict_memory_per_stage(_config("--bf16", *LORA, "--pretrained-checkpoint", str(tmp_path)))[0]
    m, config = _config().model, _config("--bf16", *LORA, "--pretrained-checkpoint", str(tmp_path))
    adapters = sum(p.numel for p in chunk_parameters(config.model, 0, 0, config.peft) if p.trainable)
    h, qkv, f = m.hidden_size, 3 * m.hidden_size, m.ffn_hidden_size
    # Per layer: qkv (64 -> 192), proj (64 -> 64), fc1 (64 -> 256), fc2 (256 -> 64), rank 8 each.
    assert adapters == 4 * 8 * ((h + qkv) + (h + h) + (h + f) + (f + h))
    assert lora.weights_bytes == full.weights_bytes + 2 * adapters  # bf16: base and adapters
    assert lora.grads_bytes == 4 * adapters  # DDP's fp32 buffer holds the adapters' gradients only
    # AdamW's two fp32 moments, fp32 masters of the bf16 adapters, a 4-byte step per adapter weight.
    assert lora.optimizer_state_bytes == 12 * adapters + 4 * 32
    assert lora.activation_bytes < full.activation_bytes


# A Mixtral-shaped variant: 4 experts, top-2, padded to capacity (the routed rows are the config's).
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --moe-grouped-gemm "
    "--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"
).split()


def _save_base(root, *arch: str) -> str:
    """A base model (one process, one iteration) for --pretrained-checkpoint; torch_dist, which
    loads at any layout, expert parallelism included."""
    ok(run_pretrain([*MODEL, *arch, "--global-batch-size", "2", "--train-iters", "1", "--save", str(root / "base"),
                     "--save-interval", "1", "--ckpt-format", "torch_dist", "--nproc-per-node", "1"], root))  # fmt: skip
    return str(root / "base")


@pytest.fixture(scope="module")
def dense_base(tmp_path_factory) -> str:
    return _save_base(tmp_path_factory.mktemp("lora_memory_dense_base"))


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory) -> str:
    return _save_base(tmp_path_factory.mktemp("lora_memory_moe_base"), *MOE)


# name -> (world size, flags)
PEAK_LAYOUTS = {
    "pp2": (2, "--pipeline-model-parallel-size 2 --global-batch-size 8"),
    "tp2": (2, "--tensor-model-parallel-size 2 --global-batch-size 8"),
    "pp2-dp2-distopt": (
        4,
        "--pipeline-model-parallel-size 2 --use-distributed-optimizer --global-batch-size 16",
    ),
    # With Bridge's regather: the column-parallel adapters keep their input split by sequence.
    "tp2-sp-dropout-regather": (
        2,
        "--tensor-model-parallel-size 2 --sequence-parallel --lora-dropout 0.1 "
        "--lora-sequence-parallel-input-regather --global-batch-size 8",
    ),
    "moe-ep2-pp2": (
        4,
        " ".join(MOE)
        + " --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --global-batch-size 16",
    ),
}


@pytest.mark.world
@pytest.mark.parametrize("name", list(PEAK_LAYOUTS))
def test_predicted_allocated_peak_of_a_lora_run_is_within_3_percent_on_every_stage(
    name, request, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    world, flags = PEAK_LAYOUTS[name]
    base = request.getfixturevalue("moe_base" if name.startswith("moe") else "dense_base")
    argv = [*MODEL, *LORA, "--pretrained-checkpoint", base, *flags.split(),
            "--nproc-per-node", str(world)]  # fmt: skip
    for stage, q in enumerate(measure(argv, world, tmp_path / "tb", quiet=True)):
        for quantity in ("weights", "grads", "optimizer", "activations"):
            measured, predicted = q[quantity]
            assert predicted == pytest.approx(measured, rel=1e-3), (name, stage, quantity)
        measured, predicted = q["peak"]
        assert abs(predicted - measured) <= 0.03 * measured, (name, stage, measured, predicted)


def test_the_lever_search_proposes_a_smaller_lora_rank_last_and_says_so(tmp_path):
    """One layer (no deeper pipeline), one rank (no sequence parallelism, no distributed optimizer):
    at rank 64 the adapters outweigh what every other lever saves, so only a smaller rank fits, and
    the preflight names its price. Every candidate with a smaller rank ranks after every other."""
    import io

    from megatron_lite.run_modes.preflight import preflight
    from megatron_lite.training.memory.levers import candidate_changes

    argv = [*MODEL, "--num-layers", "1", "--global-batch-size", "8", *LORA[:2], "--lora-alpha", "16",
            "--pretrained-checkpoint", str(tmp_path), "--nproc-per-node", "1"]  # fmt: skip
    changes = candidate_changes(parse_args([*argv, "--lora-dim", "64"]))
    ranks = [i for i, c in enumerate(changes) if "--lora-dim" in c.flags]
    assert ranks and ranks[0] == len(changes) - len(ranks)  # all of them last
    assert [changes[i].flags[-1] for i in ranks[:2]] == ["32", "32"]  # the smallest step first
    smaller = predict_memory_per_stage(parse_args([*argv, "--lora-dim", "32"]))[0].peak_bytes
    capacity = smaller / 1e9 / 0.9 * 1.0001  # fits at rank 32 after the 10% reserve, not at 64
    out = io.StringIO()
    assert preflight([*argv, "--lora-dim", "64"], capacity, out=out) == 1
    text = out.getvalue()
    assert "cheapest change that fits every stage: --lora-dim 32  (LoRA rank 32 instead of 64" in text
    assert "a lower LoRA rank adapts less" in text
    # The table names the adapters' part of the weights, and the line below it the rest of LoRA's parts.
    assert text.splitlines()[1].split()[:4] == ["stage", "weights", "adapters", "grads"]
    assert (
        " LoRA (rank 64, alpha 16, on linear_qkv, linear_proj, linear_fc1, linear_fc2): the base's weights"
        in text
    )


MOE_PADDED = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
MOE_LAYERS = {
    "grouped-bias": dict(moe_grouped_gemm=True, **MOE_PADDED),
    "sequential": dict(add_bias_linear=False, **MOE_PADDED),
    "grouped-swiglu-shared-expert": dict(
        moe_grouped_gemm=True,
        add_bias_linear=False,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        moe_shared_expert_intermediate_size=32,
        **MOE_PADDED,
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", list(MOE_LAYERS))
def test_a_lora_moe_layer_saves_what_the_count_says(name):
    """The frozen router keeps no input; the routed experts' adapters keep their low-rank rows; the
    shared expert's are a dense MLP's (padded to capacity: the routed rows are the config's)."""
    from megatron_lite.core.transformer.moe.moe_layer import MoELayer
    from megatron_lite.core.transformer.transformer_config import TransformerConfig
    from megatron_lite.training.memory.predict.lora import lora_layer_saves
    from megatron_lite.training.memory.predict.moe import moe_mlp_saves

    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=2, ffn_hidden_size=128, num_moe_experts=4,
        moe_router_topk=2, moe_aux_loss_coeff=0.01, moe_token_dispatcher_type="alltoall", **MOE_LAYERS[name],
    )  # fmt: skip
    layer = MoELayer(
        config, layer_number=1, pg_collection=ProcessGroupCollection(), seed=7,
        init_method=config.init_method, output_layer_init_method=config.output_layer_init_method,
    )  # fmt: skip
    lora = LoRA(dim=8, target_modules=["linear_fc1", "linear_fc2"])
    layer = lora(layer, training=True)
    tracker = ActivationMemoryTracker()
    tracker.exclude_parameters(layer.parameters())
    with tracker.track():
        out = layer(torch.randn(32, 2, 64, requires_grad=True))
    x = Shape(64, 64, 32, 32, 2, 4, config, lora=lora)
    # The MLP's part of a layer's count: the MoE saves and what LoRA changes of them (the layer's
    # attention and norms are another test's); "linear_fc1.input" is the router's input.
    mlp = {"linear_fc1.input": 64 * 64 * 4, **moe_mlp_saves(x)}
    saves, _ = lora_layer_saves(x, mlp, 0, moe=True)
    assert tracker.current_bytes == sum(saves.values())
    out[0].sum().backward()


def test_the_lever_search_proposes_the_sequence_parallel_input_regather_before_a_smaller_rank(tmp_path):
    """LoRA at TP 2 with sequence parallelism: --lora-sequence-parallel-input-regather keeps the
    column-parallel adapters' inputs split by sequence (less predicted activation memory, same
    numbers); it ranks with the levers that cost time, before any smaller --lora-dim."""
    from megatron_lite.training.memory.levers import candidate_changes

    argv = [*MODEL, "--global-batch-size", "8", *LORA, "--pretrained-checkpoint", str(tmp_path),
            "--tensor-model-parallel-size", "2", "--nproc-per-node", "2"]  # fmt: skip
    flag = "--lora-sequence-parallel-input-regather"
    changes = candidate_changes(parse_args([*argv, "--sequence-parallel"]))
    regather = [i for i, c in enumerate(changes) if flag in c.flags]
    smaller = [i for i, c in enumerate(changes) if "--lora-dim" in c.flags]
    assert regather and smaller and changes[regather[0]].flags == (flag,) and regather[0] < smaller[0]
    assert all(c.quality == 0 for c in changes if flag in c.flags and "--lora-dim" not in c.flags)
    # Without sequence parallelism it comes with it; with it already given it is not proposed.
    assert ("--sequence-parallel", flag) in [c.flags for c in candidate_changes(parse_args(argv))]
    assert not any(
        flag in c.flags for c in candidate_changes(parse_args([*argv, "--sequence-parallel", flag]))
    )
    sp = predict_memory_per_stage(parse_args([*argv, "--sequence-parallel"]))[0]
    both = predict_memory_per_stage(parse_args([*argv, "--sequence-parallel", flag]))[0]
    # One microbatch in flight (pp 1): 4 layers x 2 adapters keep t' h e instead of t h e (t = 64 tokens).
    assert sp.activation_bytes - both.activation_bytes == 4 * 2 * (64 - 32) * 64 * 4
