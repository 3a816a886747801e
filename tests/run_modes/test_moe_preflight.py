"""--memory-preflight for MoE models: open routing is judged on the worst routing's bound (balanced
routing's figures beside it), and the lever search adds a larger expert-parallel size and a padded
capacity factor, the latter only after every change that keeps all tokens."""

from __future__ import annotations

import io
import json
import re

from megatron_lite.run_modes.preflight import preflight
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.memory.levers import candidate_changes
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

# 32 experts all on each rank (ep 1) of 8 data-parallel ranks, short sequences: the weights dominate.
WEIGHT_BOUND = (
    "--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --ffn-hidden-size 4096 --seq-length 256 "
    "--max-position-embeddings 256 --vocab-size 1024 --micro-batch-size 1 --global-batch-size 8 "
    "--num-experts 32 --moe-router-topk 2 --moe-grouped-gemm --disable-bias-linear "
    "--use-distributed-optimizer --bf16 --nproc-per-node 8"
).split()
# One expert per rank (ep 8), 4096-token sequences, recomputation already full and nothing to split:
# the worst routing's rows (every token of the 8 ranks sent to one expert) dominate.
ROUTING_BOUND = (
    "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 --seq-length 4096 "
    "--max-position-embeddings 4096 --vocab-size 1024 --micro-batch-size 1 --global-batch-size 8 "
    "--num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 --moe-grouped-gemm "
    "--disable-bias-linear --use-distributed-optimizer --bf16 --nproc-per-node 8 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
).split()


def _run(argv, device_gb, json_path=None) -> tuple[int, str]:
    out = io.StringIO()
    code = preflight(argv, device_gb, out, json_path=None if json_path is None else str(json_path))
    return code, out.getvalue()


def _fix(stdout: str) -> list[str]:
    return re.search(r"cheapest change that fits every stage: (.*?)  \(", stdout).group(1).split()


def test_open_routing_is_judged_on_the_worst_bound_with_balanced_routing_beside(tmp_path):
    config = parse_args(ROUTING_BOUND)
    worst = predict_memory_per_stage(config, device_type="cuda", routing="worst")
    balanced = predict_memory_per_stage(config, device_type="cuda", routing="balanced")
    assert balanced[0].peak_bytes < 0.54e9 < worst[0].peak_bytes  # fits balanced only, on 0.6 GB
    code, stdout = _run(ROUTING_BOUND, 0.6, tmp_path / "preflight.json")
    assert code == 1
    assert "verdict: does not fit under worst routing: stage 0 runs out first" in stdout
    assert f"{balanced[0].peak_bytes / 1e9:.2f} GB under balanced routing" in stdout
    record = json.loads((tmp_path / "preflight.json").read_text())
    stage = record["stages"][0]
    assert record["moe_routing"] == "worst"
    assert stage["predicted_max_allocated_bytes"] == worst[0].peak_bytes
    assert stage["predicted_max_allocated_bytes_balanced"] == balanced[0].peak_bytes


def test_weight_bound_moe_job_is_fixed_by_a_larger_expert_parallel_size():
    code, stdout = _run(WEIGHT_BOUND, 4.5)
    assert code == 1, stdout
    fix = _fix(stdout)
    assert fix == ["--expert-model-parallel-size", "2"], stdout
    assert _run([*WEIGHT_BOUND, *fix], 4.5)[0] == 0  # the recommended command fits, by the prediction


def test_routing_bound_moe_job_is_fixed_by_a_padded_capacity_factor_said_to_drop_tokens():
    code, stdout = _run(ROUTING_BOUND, 0.6)
    assert code == 1, stdout
    fix = _fix(stdout)
    assert fix == ["--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"], stdout
    assert "drops the tokens routed past an expert's capacity" in stdout
    code, applied = _run([*ROUTING_BOUND, *fix], 0.6)
    assert code == 0 and "verdict: fits" in applied and "under balanced routing" not in applied


def test_expert_levers_keep_the_world_and_capacity_ranks_after_every_lossless_change():
    changes = candidate_changes(parse_args(WEIGHT_BOUND))
    sizes = {
        c.flags[c.flags.index("--expert-model-parallel-size") + 1]
        for c in changes
        if "--expert-model-parallel-size" in c.flags
    }
    assert sizes == {"2", "4", "8"}  # divide 32 experts and the 8 ranks of the stage; 16 and 32 do not
    drops = ["--moe-expert-capacity-factor" in c.flags for c in changes]
    assert any(drops) and drops == sorted(drops)  # every token-dropping change after every other
