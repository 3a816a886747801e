"""Megatron-LM's mixture-of-experts flags map onto the model config and are checked before any worker
starts: upstream's rules, and one line for what megatron_lite's MoE layer does not do yet."""

from __future__ import annotations

import pytest
from dist_helpers import run_pretrain, run_world

from megatron_lite.training.arguments import config_from_argv
from megatron_lite.training.cli.moe_args import parse_moe_layer_freq
from megatron_lite.training.config import ConfigContainer, ConfigError

MOE = ["--num-experts", "4"]
TP2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear"]


def _error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_argv(argv)
    return str(err.value)


def test_a_full_moe_command_line_maps_onto_every_field():
    cfg = config_from_argv(
        "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128 "
        "--tensor-model-parallel-size 2 --sequence-parallel --nproc-per-node 4 "
        "--num-experts 4 --moe-layer-freq ([1]*1+[0]*1)*2 --moe-ffn-hidden-size 32 "
        "--moe-shared-expert-intermediate-size 64 --moe-shared-expert-gate --moe-router-topk 1 "
        "--moe-router-load-balancing-type none --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
        "--moe-router-score-function sigmoid --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5 "
        "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-expert-capacity-factor 1.5 "
        "--moe-pad-expert-input-to-capacity --moe-token-drop-policy position "
        "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1".split()
    )
    m = cfg.model
    assert (m.num_moe_experts, m.moe_layer_freq, m.moe_ffn_hidden_size) == (4, [1, 0, 1, 0], 32)
    assert (m.moe_shared_expert_intermediate_size, m.moe_shared_expert_gate) == (64, True)
    assert (m.moe_router_topk, m.moe_router_load_balancing_type) == (1, "none")
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (0.01, 0.001)
    assert (m.moe_router_score_function, m.moe_router_pre_softmax) == ("sigmoid", True)
    assert (m.moe_router_topk_scaling_factor, m.moe_token_dispatcher_type) == (2.5, "alltoall")
    assert (m.moe_grouped_gemm, m.moe_expert_capacity_factor) == (True, 1.5)
    assert (m.moe_pad_expert_input_to_capacity, m.moe_token_drop_policy) == (True, "position")
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (2, 1)


def test_num_experts_alone_gets_upstreams_defaults():
    m = config_from_argv([*MOE, "--ffn-hidden-size", "96"]).model
    assert m.moe_ffn_hidden_size == 96  # upstream: ffn_hidden_size
    assert (m.moe_layer_freq, m.moe_router_topk, m.moe_router_load_balancing_type) == (1, 2, "aux_loss")
    assert (m.moe_aux_loss_coeff, m.moe_z_loss_coeff, m.moe_expert_capacity_factor) == (0.0, None, None)
    assert (m.moe_router_score_function, m.moe_token_dispatcher_type) == ("softmax", "allgather")
    assert (m.expert_model_parallel_size, m.expert_tensor_parallel_size) == (1, None)


def test_values_upstream_maps_are_mapped_the_same():
    assert config_from_argv(["--num-experts", "0"]).model.num_moe_experts is None  # a dense model
    m = config_from_argv(
        "--num-experts 4 --moe-expert-capacity-factor -1 --moe-router-load-balancing-type aux_loss "
        "--moe-aux-loss-coeff 0.1".split()
    ).model
    assert m.moe_expert_capacity_factor is None  # negative: no capacity limit
    assert (m.moe_router_load_balancing_type, m.moe_aux_loss_coeff) == ("aux_loss", 0.1)  # a list of one


@pytest.mark.parametrize(
    "text,pattern",
    [
        ("2", 2),
        ("([1]*3+[0]*1)*3", [1, 1, 1, 0] * 3),
        ("[1,0,1,0]", [1, 0, 1, 0]),
        ("([0]+[1]*3)", [0, 1, 1, 1]),
        ("2*[1, 0]", [1, 0, 1, 0]),
    ],
)
def test_moe_layer_freq_is_an_int_or_a_0_1_list_expression(text, pattern):
    assert parse_moe_layer_freq(text) == pattern


@pytest.mark.parametrize(
    "text",
    ["__import__('os').system('true')", "[1]*2**3", "[2]", "[True]", "[1]+1", "1.5", "[[1]]", "[1]*-1", ""],
)
def test_moe_layer_freq_refuses_anything_else_without_evaluating_it(text):
    with pytest.raises(ConfigError) as err:
        parse_moe_layer_freq(text)
    assert str(err.value) == (
        f"--moe-layer-freq: {text!r} is not an integer or a list of 0/1 such as '([1]*3+[0]*1)*3' "
        "(literals, + and *)"
    )


def test_moe_layer_freq_too_long_is_refused_before_it_is_built():
    with pytest.raises(
        ConfigError, match=r"^--moe-layer-freq: '\[1\]\*10000000000000' gives more than 100000"
    ):
        parse_moe_layer_freq("[1]*10000000000000")


def test_moe_layer_freq_is_one_flag_per_layer_or_a_positive_int():
    assert _error([*MOE, "--num-layers", "4", "--moe-layer-freq", "[1,0]"]) == (
        "--moe-layer-freq: has 2 entries; it needs one per layer (--num-layers 4)"
    )
    assert _error([*MOE, "--moe-layer-freq", "0"]) == (
        "--moe-layer-freq: must be >= 1 (every N-th layer is MoE), got 0"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--moe-ffn-hidden-size", "32"],
        ["--moe-layer-freq", "2"],
        ["--moe-router-topk", "1"],
        ["--moe-router-load-balancing-type", "none"],
        ["--moe-aux-loss-coeff", "0.01"],
        ["--moe-z-loss-coeff", "0"],
        ["--moe-grouped-gemm"],
        ["--moe-token-dispatcher-type", "alltoall"],
        ["--moe-expert-capacity-factor", "1.0"],
        ["--expert-model-parallel-size", "2"],
    ],
)
def test_each_moe_flag_needs_num_experts(argv):
    assert _error(argv) == f"{argv[0]}: needs --num-experts"


def test_experts_split_over_expert_parallel_ranks():
    argv = [*MOE, "--expert-model-parallel-size", "3", "--nproc-per-node", "3", "--global-batch-size", "6"]
    assert _error(argv) == (
        "--expert-model-parallel-size: 4 experts do not split over 3 expert-parallel ranks; "
        "use a divisor of --num-experts"
    )


def test_router_topk_is_at_most_num_experts():
    assert _error([*MOE, "--moe-router-topk", "5"]) == (
        "--moe-router-topk: must be between 1 and --num-experts 4, got 5"
    )


@pytest.mark.parametrize(
    "flag,value,allowed",
    [
        ("--moe-router-load-balancing-type", "seq_aux_loss", "aux_loss or none"),
        ("--moe-router-load-balancing-type", "global_aux_loss", "aux_loss or none"),
        ("--moe-router-load-balancing-type", "sinkhorn", "aux_loss or none"),
        ("--moe-token-dispatcher-type", "flex", "allgather or alltoall"),
    ],
)
def test_upstream_choices_not_built_yet_are_refused(flag, value, allowed):
    assert _error([*MOE, flag, value]) == (
        f"{flag}: {value!r} is not supported yet by megatron_lite; use {allowed}"
    )


@pytest.mark.parametrize(
    "flag,value,allowed",
    [
        ("--moe-router-load-balancing-type", "random", "aux_loss or none"),
        ("--moe-router-score-function", "relu", "softmax or sigmoid"),
        ("--moe-token-dispatcher-type", "nccl", "allgather or alltoall"),
        ("--moe-token-drop-policy", "random", "probs or position"),
    ],
)
def test_unknown_choices_are_refused(flag, value, allowed):
    assert _error([*MOE, flag, value]) == f"{flag}: must be {allowed}, got {value!r}"


@pytest.mark.parametrize(
    "flag,values",
    [("--moe-router-load-balancing-type", ["aux_loss", "none"]), ("--moe-aux-loss-coeff", ["0.1", "0.2"])],
)
def test_several_values_of_a_list_flag_are_refused(flag, values):
    parsed = [float(v) for v in values] if flag == "--moe-aux-loss-coeff" else values
    assert _error([*MOE, flag, *values]) == (
        f"{flag}: takes one value in megatron_lite (several are not supported yet), got {parsed}"
    )


@pytest.mark.parametrize("capacity", [[], ["--moe-expert-capacity-factor", "-1"]], ids=["none", "negative"])
def test_padding_to_capacity_needs_a_capacity_factor(capacity):
    assert _error([*MOE, *capacity, "--moe-pad-expert-input-to-capacity"]) == (
        "--moe-pad-expert-input-to-capacity: needs --moe-expert-capacity-factor"
    )


def test_a_zero_capacity_factor_is_refused():
    assert _error([*MOE, "--moe-expert-capacity-factor", "0"]) == (
        "--moe-expert-capacity-factor: must be positive, got 0.0 (leave it out, or None, for no capacity limit)"
    )


def test_a_capacity_factor_needs_aux_loss_or_no_load_balancing():
    argv = [*MOE, "--moe-expert-capacity-factor", "1.0", "--moe-router-load-balancing-type", "sinkhorn"]
    assert _error(argv) == (
        "--moe-expert-capacity-factor: only works with aux_loss or none load balancing (as upstream), "
        "not 'sinkhorn'"
    )


@pytest.mark.parametrize("flag", ["--moe-aux-loss-coeff", "--moe-z-loss-coeff"])
def test_loss_coefficients_are_not_negative(flag):
    assert _error([*MOE, flag, "-0.1"]) == f"{flag}: must be a finite number >= 0, got -0.1"


def test_shared_expert_gate_needs_a_shared_expert():
    assert _error([*MOE, "--moe-shared-expert-gate"]) == (
        "--moe-shared-expert-gate: needs --moe-shared-expert-intermediate-size (upstream ignores it without)"
    )


def test_moe_with_tensor_parallelism_needs_sequence_parallel():
    argv = [*MOE, "--tensor-model-parallel-size", "2", "--disable-bias-linear"]
    assert _error(argv) == "--num-experts: with --tensor-model-parallel-size 2 needs --sequence-parallel"


def test_expert_tensor_parallelism_with_biases_is_refused():
    argv = [*MOE, "--tensor-model-parallel-size", "2", "--sequence-parallel"]
    assert _error(argv) == (
        "--expert-tensor-parallel-size: expert biases need expert tensor parallel size 1 "
        "(or --disable-bias-linear), got 2 (its default, --tensor-model-parallel-size)"
    )
    assert _error([*MOE, "--expert-tensor-parallel-size", "2", "--nproc-per-node", "2"]) == (
        "--expert-tensor-parallel-size: expert biases need expert tensor parallel size 1 "
        "(or --disable-bias-linear), got 2"
    )


def test_expert_and_shared_expert_sizes_must_split_over_their_tensor_parallel_ranks():
    assert _error([*MOE, *TP2, "--moe-ffn-hidden-size", "33"]) == (
        "--moe-ffn-hidden-size: 33 does not split over expert tensor parallel size 2; use a multiple of 2"
    )
    argv = [*MOE, *TP2, "--expert-tensor-parallel-size", "1", "--moe-ffn-hidden-size", "33"]
    assert config_from_argv(argv).model.moe_ffn_hidden_size == 33  # whole experts on every rank
    assert _error([*MOE, *TP2, "--moe-shared-expert-intermediate-size", "17"]) == (
        "--moe-shared-expert-intermediate-size: 17 does not split over tensor parallel size 2; "
        "use a multiple of 2"
    )


def test_expert_tensor_parallelism_without_biases_or_with_etp_1_is_accepted():
    assert config_from_argv([*MOE, *TP2]).model.expert_tensor_parallel_size is None
    argv = "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1".split()
    assert config_from_argv([*MOE, *argv]).model.add_bias_linear


def test_the_expert_grid_must_split_each_stages_ranks():
    """parallel_state's assertion, as one line: tp x cp x dp must divide into groups of etp x ep."""
    assert _error([*MOE, "--expert-model-parallel-size", "2"]) == (
        "--expert-model-parallel-size: tp x cp x dp = 1 ranks per pipeline stage do not split into expert "
        "groups of etp x ep = 1 x 2; use a world size (--nproc-per-node) that is a multiple of 2"
    )
    argv = [*MOE, *TP2, "--expert-model-parallel-size", "4", "--pipeline-model-parallel-size", "2"]
    assert _error([*argv, "--nproc-per-node", "12", "--global-batch-size", "12"]) == (
        "--expert-model-parallel-size: tp x cp x dp = 6 ranks per pipeline stage do not split into expert "
        "groups of etp x ep = 2 x 4; use a world size (--nproc-per-node) that is a multiple of 16"
    )


def test_expert_parallelism_leaves_world_and_data_parallel_size_alone():
    cfg = config_from_argv([*MOE, "--expert-model-parallel-size", "2", "--nproc-per-node", "2"])
    assert (cfg.world_size, cfg.data_parallel_size, cfg.num_microbatches) == (2, 2, 4)


def test_moe_recompute_modules_are_refused():
    argv = [*MOE, "--recompute-granularity", "selective", "--recompute-modules", "moe"]
    assert _error(argv) == "--recompute-modules: 'moe' is not one of core_attn, mlp (megatron_lite)"


@pytest.mark.parametrize(
    "fields,error",
    [
        ({"num_moe_experts": 0}, r"--num-experts: must be >= 1 \(or None for a dense model\), got 0"),
        ({"num_moe_experts": 4, "moe_aux_loss_coeff": [0.01]}, "--moe-aux-loss-coeff: takes one value"),
        ({"num_moe_experts": 4, "moe_layer_freq": "[1]*8"}, "--moe-layer-freq: must be an integer or a list"),
        ({"moe_router_topk": 1}, "--moe-router-topk: needs --num-experts$"),
    ],
)
def test_the_python_api_gets_the_same_checks(fields, error):
    cfg = ConfigContainer()
    for name, value in fields.items():
        setattr(cfg.model, name, value)
    with pytest.raises(ConfigError, match=f"^{error}"):
        cfg.validate()


@pytest.mark.world
def test_pretrain_refuses_a_bad_moe_layout_in_one_line(tmp_path):
    result = run_pretrain([*MOE, "--expert-model-parallel-size", "2", "--save", "ck"], tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        "pretrain.py: error: --expert-model-parallel-size: tp x cp x dp = 1 ranks per pipeline stage do not "
        "split into expert groups of etp x ep = 1 x 2; use a world size (--nproc-per-node) that is a multiple of 2\n"
    )
    assert "Traceback" not in result.stdout and list(tmp_path.iterdir()) == []


def _expert_group_sizes(rank: int, world: int, argv: list[str]) -> tuple[int, int, int, int]:
    from megatron_lite.core import parallel_state as ps
    from megatron_lite.training.initialize import initialize_megatron

    initialize_megatron(config_from_argv(argv))
    return (
        ps.get_expert_model_parallel_world_size(),
        ps.get_expert_tensor_parallel_world_size(),
        ps.get_expert_data_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )


@pytest.mark.world
def test_initialize_builds_the_expert_groups_of_the_flags():
    argv = [*MOE, *TP2, "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"]
    sizes = run_world(_expert_group_sizes, 4, [*argv, "--nproc-per-node", "4"])
    assert sizes == [(2, 1, 2, 2)] * 4  # ep x etp x expert dp = 4 ranks; the dense dp stays 2
