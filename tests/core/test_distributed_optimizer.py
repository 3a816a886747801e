"""Distributed optimizer and overlapped reduction: buckets, shards, memory, parity, checkpoints."""

from __future__ import annotations

import pytest
import torch
from dist_helpers import SMALL_MODEL, parse_losses, run_pretrain, run_world

ITERS = 8
SHARDED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]
SMALL_BUCKETS = ["--ddp-bucket-size", "6000"]  # several buckets, so overlap has something to overlap


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _model(dtype):
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(33, 64), torch.nn.GELU(), torch.nn.Linear(64, 47), torch.nn.LayerNorm(47)
    ).to(dtype)


def _world(rank, world_size):
    import torch.distributed as dist

    from megatron_lite.core.distributed import DistributedDataParallel
    from megatron_lite.core.optimizer import MegatronOptimizer, OptimizerConfig
    from megatron_lite.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron_lite.training.memory.report import OPTIMIZER_STATE_MEMORY, report_memory

    group = dist.new_group(list(range(world_size)))
    out = {}
    x = torch.randn(5, 33, generator=torch.Generator().manual_seed(rank))
    for dtype in (torch.float32, torch.bfloat16):
        state_bytes = {}
        for sharded in (False, True):
            ddp_cfg = _Cfg(
                use_distributed_optimizer=sharded, overlap_grad_reduce=True, overlap_param_gather=sharded
            )
            ddp = DistributedDataParallel(
                None, _model(dtype), dp_group=group, bucket_size=1000, ddp_config=ddp_cfg
            )
            config = OptimizerConfig(bf16=dtype == torch.bfloat16)
            cls = DistributedOptimizer if sharded else MegatronOptimizer
            kwargs = {"dp_group": group} if sharded else {}
            opt = cls(config, [ddp], **kwargs)
            ddp.zero_grad_buffer()
            ddp(x.to(dtype)).float().pow(2).sum().backward()
            # The overlap hooks launched every bucket during backward: nothing is left to start.
            out[f"started_{dtype}_{sharded}"] = all(b.grad_sync_started for b in ddp.buckets)
            # Oracle input: the same model's own gradient on this rank's batch, by plain autograd.
            ref = _model(dtype)
            ref(x.to(dtype)).float().pow(2).sum().backward()
            local = [p.grad.float() for p in ref.parameters()]
            ddp.finish_grad_sync()
            # Oracle: the mean over ranks of each rank's own gradient, from an all-gather.
            means = []
            for g in local:
                parts = [torch.zeros_like(g) for _ in range(world_size)]
                dist.all_gather(parts, g, group=group)
                means.append(torch.stack(parts).mean(0))
            ok = True
            for bucket in ddp.buckets:
                reduced = bucket.shard(bucket.grad_data) if sharded else bucket.grad_data
                lo = bucket.dp_rank * reduced.numel() if sharded else 0
                flat_mean = torch.zeros_like(bucket.grad_data)
                for p in bucket.params:
                    i = next(i for i, q in enumerate(ddp.module.parameters()) if q is p)
                    start = ddp._buffer_of[p].param_index_map[p][0] - bucket.offset
                    flat_mean[start : start + p.numel()] = means[i].view(-1)
                ok &= torch.allclose(reduced, flat_mean[lo : lo + reduced.numel()], rtol=1e-6, atol=1e-7)
                ok &= bucket.grad_data.numel() % (world_size if sharded else 1) == 0
            out[f"reduced_{dtype}_{sharded}"] = ok
            opt.step()
            ddp.finish_param_sync()
            weights = torch.cat([p.detach().float().view(-1) for p in ddp.module.parameters()])
            gathered = [torch.zeros_like(weights) for _ in range(world_size)]
            dist.all_gather(gathered, weights, group=group)
            out[f"replicas_equal_{dtype}_{sharded}"] = all(torch.equal(gathered[0], w) for w in gathered)
            out[f"weights_{dtype}_{sharded}"] = weights.tolist()  # plain data: the queue outlives the rank
            state_bytes[sharded] = opt.optimizer_state_bytes()
            OPTIMIZER_STATE_MEMORY.track(opt)
            out[f"report_{dtype}_{sharded}"] = report_memory()["mem-optimizer-state-gigabytes"]
        out[f"bytes_{dtype}"] = state_bytes
        out[f"numel_{dtype}"] = sum(p.numel() for p in _model(dtype).parameters())
    # force_all_reduce (upstream's finalize_model_grads argument): the whole buffer, not a shard.
    cfg = _Cfg(use_distributed_optimizer=True, overlap_grad_reduce=False, overlap_param_gather=False)
    ddp = DistributedDataParallel(None, _model(torch.float32), dp_group=group, ddp_config=cfg)
    ddp(x).pow(2).sum().backward()
    ddp.finish_grad_sync(force_all_reduce=True)
    whole = ddp.buckets[0].grad_data
    replicas = [torch.zeros_like(whole) for _ in range(world_size)]
    dist.all_gather(replicas, whole, group=group)
    out["force_all_reduce_replicated"] = all(torch.equal(replicas[0], r) for r in replicas)
    return out


@pytest.fixture(scope="module")
def dp4():
    return run_world(_world, 4)


@pytest.mark.world
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_state_bytes_at_dp4_are_a_quarter(dp4, dtype):
    for rank_out in dp4:
        full, sharded = rank_out[f"bytes_{dtype}"][False], rank_out[f"bytes_{dtype}"][True]
        per_param = 12 if dtype == torch.bfloat16 else 8  # two fp32 moments, plus the fp32 master
        assert full == per_param * rank_out[f"numel_{dtype}"] + 4 * 6  # + one fp32 step per tensor
        padding = per_param * 4 * 4  # at most dp - 1 padding elements per bucket (4 buckets)
        assert full / 4 - padding <= sharded <= full / 4 + padding
    assert sum(r[f"bytes_{dtype}"][True] for r in dp4) == pytest.approx(full, abs=4 * padding)


@pytest.mark.world
def test_memory_report_measures_the_optimizer_state(dp4):
    r = dp4[0]
    assert r[f"report_{torch.float32}_True"] == float(f"{r[f'bytes_{torch.float32}'][True] / 1e9:.5g}")
    assert r[f"report_{torch.bfloat16}_False"] == float(f"{r[f'bytes_{torch.bfloat16}'][False] / 1e9:.5g}")


@pytest.mark.world
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sharded", [False, True])
def test_overlapped_buckets_reduce_to_the_mean_over_ranks(dp4, dtype, sharded):
    for r in dp4:
        assert r[f"started_{dtype}_{sharded}"] and r[f"reduced_{dtype}_{sharded}"]
        assert r[f"replicas_equal_{dtype}_{sharded}"]


@pytest.mark.world
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sharded_step_equals_replicated_step(dp4, dtype):
    full = torch.tensor(dp4[0][f"weights_{dtype}_False"])
    sharded = torch.tensor(dp4[0][f"weights_{dtype}_True"])
    assert torch.allclose(full, sharded, rtol=1e-6, atol=1e-7)


# Per-iteration lm loss over 8 iterations: the flags change how gradients and parameters move, not
# what they are. 16 samples per batch so dp = 4 still accumulates two microbatches.
def _losses(tmp_path, layout: str, extra=()) -> dict[int, float]:
    tp, pp, dp = (int(v) for v in layout.split("x"))
    args = [
        *SMALL_MODEL,
        *f"--global-batch-size 16 --train-iters {ITERS} --seed 1234 --tensor-model-parallel-size {tp} "
        f"--pipeline-model-parallel-size {pp} --nproc-per-node {tp * pp * dp}".split(),
        *extra,
    ]
    result = run_pretrain(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = parse_losses(result.stdout)
    assert sorted(losses) == list(range(1, ITERS + 1)), result.stdout
    return losses


def _assert_parity(got, want, rel):
    for it in range(1, ITERS + 1):
        assert abs(got[it] - want[it]) <= rel * abs(want[it]), (it, got[it], want[it])


@pytest.fixture(scope="module")
def dp2_reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("dp2"), "1x1x2")


@pytest.mark.world
@pytest.mark.parametrize(
    "flags",
    [
        ["--use-distributed-optimizer"],
        ["--overlap-grad-reduce", *SMALL_BUCKETS],
        [*SHARDED, *SMALL_BUCKETS],
    ],
    ids=["distributed-optimizer", "overlap-grad-reduce", "all-flags"],
)
def test_dp2_loss_parity(tmp_path, dp2_reference, flags):
    _assert_parity(_losses(tmp_path, "1x1x2", flags), dp2_reference, 1e-6)


# tp x pp x dp: all flags together, dp = 4 and 2 with pp = 2, dp = 2 with tp = 2 (dp alone: above, and
# dp = 4 in-process; the 8-rank tp 2 x dp 4 world adds half a minute and no new path).
@pytest.mark.world
@pytest.mark.parametrize("layout", ["1x2x4", "1x2x2", "2x1x2"])
def test_loss_parity_with_all_flags(tmp_path, layout):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _losses(tmp_path / "a", layout)
    _assert_parity(_losses(tmp_path / "b", layout, [*SHARDED, *SMALL_BUCKETS]), plain, 1e-6)


@pytest.mark.world
def test_bf16_loss_parity(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = _losses(tmp_path / "a", "1x1x2", ["--bf16"])
    sharded = _losses(tmp_path / "b", "1x1x2", ["--bf16", *SHARDED, *SMALL_BUCKETS])
    _assert_parity(sharded, plain, 5e-3)
    assert sharded[ITERS] < sharded[1]


@pytest.mark.parametrize("bf16,full,sharded", [(False, 16, 8 + 8 / 4), (True, 18, 6 + 12 / 4)])
def test_theoretical_memory_divides_the_optimizer_share_by_dp(bf16, full, sharded):
    from megatron_lite.training.arguments import build_parser, config_from_args
    from megatron_lite.training.utils.theoretical_memory_utils import report_theoretical_memory

    def estimate(extra):
        args = [*SMALL_MODEL, "--global-batch-size", "16", *(["--bf16"] if bf16 else []), *extra]
        config = config_from_args(build_parser().parse_args(args))
        config.data_parallel_size = 4
        return report_theoretical_memory(config)

    assert estimate(["--use-distributed-optimizer"]) / estimate([]) == pytest.approx(sharded / full)


@pytest.mark.world
def test_force_all_reduce_reduces_the_whole_buffer(dp4):
    assert all(r["force_all_reduce_replicated"] for r in dp4)
