"""DistributedOptimizer (ZeRO-1 as Megatron does it): optimizer state sharded over data parallelism.

Every data-parallel rank owns the same contiguous 1/dp of each DDP bucket (``bucket.shard``). For
each parameter overlapping that shard the optimizer keeps an fp32 main parameter for the overlap
only (a view into the parameter buffer for fp32 models, an fp32 copy for bf16 ones) and AdamW state
for it. A step reads the reduce-scattered gradient shard, clips by the global norm (the shards'
squares summed over dp, then over the model-parallel group), updates the shard, writes it into the
parameter buffer, and all-gathers every bucket's parameters back (asynchronously with
``overlap_param_gather``).

Checkpoints use upstream's legacy ``dp_zero`` form: ``get_parameter_state_dp_zero`` gathers the
shards (of an expert buffer: over the expert-dp group) into one fp32 tensor per buffer and key
(``param``, ``exp_avg``, ``exp_avg_sq``) with bucket padding removed, so a load may use another
data-parallel size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.optimizer.optimizer import MegatronOptimizer, checkpoint_tensors_by_param
from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig
from megatron_lite.core.optimizer.sharded_state import common_state
from megatron_lite.core.process_group_utils import get_collective_device

STATE_KEYS = ("exp_avg", "exp_avg_sq")


class _ShardRange:
    """The part ``[start, end)`` (flat, within ``param``) of one parameter in this rank's shard: a
    MainParam whose ``model`` is that part of the parameter buffer."""

    def __init__(self, param, buffer, bucket, start, end, local_start):
        self.param, self.buffer, self.bucket = param, buffer, bucket
        self.start, self.end = start, end
        self.local_start = local_start  # where it sits in this rank's shard of the bucket
        begin = buffer.param_index_map[param][0]
        self.model = buffer.param_data[begin + start : begin + end]
        self.grad_view = buffer.grad_data[begin + start : begin + end]
        # fp32 model: update the parameter buffer in place; otherwise an fp32 master copy.
        fp32 = param.dtype == torch.float32
        self.main = self.model if fp32 else self.model.detach().float()


def _shard_ranges(model_chunks) -> list[_ShardRange]:
    ranges = []
    for chunk in model_chunks:
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                shard_size = bucket.grad_data.numel() // bucket.dp_size
                lo = bucket.offset + bucket.dp_rank * shard_size
                hi = lo + shard_size
                for p in bucket.params:
                    begin, end, _ = buffer.param_index_map[p]
                    a, b = max(begin, lo), min(end, hi)
                    if a < b:
                        ranges.append(_ShardRange(p, buffer, bucket, a - begin, b - begin, a - lo))
    return ranges


def _gather(tensor: torch.Tensor, bucket, everywhere: bool) -> list[torch.Tensor] | None:
    """Every rank's ``tensor`` over ``bucket``'s data-parallel group, in rank order: on its rank 0
    only (None elsewhere), or on every rank with ``everywhere``."""
    if bucket.dp_size == 1:
        return [tensor]
    # On the group's device (NCCL takes only CUDA tensors), back on the host after.
    device = get_collective_device(bucket.dp_group)
    tensor = tensor.to(device)
    gathered = [torch.zeros_like(tensor) for _ in range(bucket.dp_size)]
    if everywhere:
        dist.all_gather(gathered, tensor, group=bucket.dp_group)
        return [t.cpu() for t in gathered]
    dist.gather(tensor, gathered if bucket.dp_rank == 0 else None, group=bucket.dp_group, group_dst=0)
    return [t.cpu() for t in gathered] if bucket.dp_rank == 0 else None


class DistributedOptimizer(MegatronOptimizer):
    """MegatronOptimizer over this rank's shard of every DDP bucket: its main parameters are shard
    ranges, its gradients the reduce-scattered shard, its norm adds up over the dp groups too, and a
    step ends by all-gathering the parameters."""

    keeps_empty_groups = True  # a rank's shard may hold no matrix, or no bias

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks,
        *,
        model_parallel_group=None,
        tp_group=None,
        dp_group=None,
        foreach: bool | None = None,
        expert_model_parallel_group=None,
        expert_dp_group=None,
    ):
        """A MoE model's expert buckets are sharded over ``expert_dp_group`` (DDP built them so)."""
        assert all(chunk.use_distributed_optimizer for chunk in model_chunks), (
            "DistributedOptimizer needs DistributedDataParallel built with use_distributed_optimizer"
        )
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self._loaded_step = 0.0
        super().__init__(
            config,
            model_chunks,
            model_parallel_group=model_parallel_group,
            tp_group=tp_group,
            foreach=foreach,
            expert_model_parallel_group=expert_model_parallel_group,
        )

    def _main_params(self) -> list[_ShardRange]:
        return _shard_ranges(self.model_chunks)

    def _gradients(self) -> list[torch.Tensor]:
        return [r.grad_view for r in self.units]

    def _norm_groups(self) -> dict:
        return {"data_parallel_group": self.dp_group, "expert_data_parallel_group": self.expert_dp_group}

    def _after_step(self) -> None:
        for chunk in self.model_chunks:
            chunk.start_param_sync()

    @torch.no_grad()
    def reload_model_params(self, state_dict: dict | None = None) -> None:
        """MegatronOptimizer.reload_model_params for this rank's shard of each parameter."""
        sources = checkpoint_tensors_by_param(self.model_chunks, state_dict) if state_dict else {}
        for r in self.units:
            if r.main is not r.model:
                source = sources[r.param].reshape(-1)[r.start : r.end] if sources else r.model
                r.main.copy_(source)

    # Checkpoints --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Hyper-parameters and the step count; the tensors go to ``distrib_optim.pt``."""
        return {**common_state(self), "use_distributed_optimizer": True}

    def load_state_dict(self, state: dict) -> None:
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        self._loaded_step = state["step"]

    def _buffers(self):
        return [buf for chunk in self.model_chunks for buf in chunk.buffers]

    def get_parameter_state_dp_zero(self) -> dict | None:
        """Every rank's shards gathered, bucket padding removed (upstream's legacy form): a dense
        bucket over the dp group, an expert bucket over the expert-dp group (each bucket's own). A
        dense model gathers on dp rank 0 (None on the others); a MoE model's state is all-gathered,
        since the rank that writes a (tp, pp, ep) shard need not be rank 0 of both groups. Collective
        over the dp and expert-dp groups."""
        everywhere = self.has_experts
        dp_rank = 0 if self.dp_group is None else dist.get_rank(self.dp_group)
        state: dict = {"buckets_coalesced": True}
        for index, buffer in enumerate(self._buffers()):
            numel_unpadded = sum(b.numel_unpadded for b in buffer.buckets)
            world = {k: torch.zeros(numel_unpadded) for k in ("param", *STATE_KEYS)}
            offset = 0
            for bucket in buffer.buckets:
                for k, tensor in self._bucket_shards(bucket).items():
                    gathered = _gather(tensor, bucket, everywhere)
                    if gathered is not None:
                        world[k][offset : offset + bucket.numel_unpadded] = torch.cat(gathered)[
                            : bucket.numel_unpadded
                        ]
                offset += bucket.numel_unpadded
            world["numel_unpadded"] = numel_unpadded
            state[index] = {str(buffer.grad_data.dtype): world, "dtype": str(buffer.param_data.dtype)}
        state["per_bucket_numel_unpadded"] = self.per_bucket_numel_unpadded()
        return state if everywhere or dp_rank == 0 else None

    def _bucket_shards(self, bucket) -> dict:
        """This rank's shard of ``bucket`` per key (``param``, the moments), zeros where no range is."""
        shard_size = bucket.grad_data.numel() // bucket.dp_size
        local = {k: torch.zeros(shard_size) for k in ("param", *STATE_KEYS)}
        for r in self.units:
            if r.bucket is bucket:
                n = r.end - r.start
                moments = self.optimizer.state.get(r.main, {})
                local["param"][r.local_start : r.local_start + n] = r.main.detach().cpu()
                for k in STATE_KEYS:
                    if k in moments:
                        local[k][r.local_start : r.local_start + n] = moments[k].cpu()
        return local

    def per_bucket_numel_unpadded(self) -> list[list[int]]:
        return [[b.numel_unpadded for b in buf.buckets] for buf in self._buffers()]

    @torch.no_grad()
    def load_parameter_state_from_dp_zero(self, state: dict) -> None:
        """Take this rank's shard of every saved tensor (any saved dp size: offsets are unpadded)."""
        step = torch.tensor(self._loaded_step, dtype=torch.float32)
        buffers = self._buffers()
        for r in self.units:
            world = state[buffers.index(r.buffer)][str(r.buffer.grad_data.dtype)]
            at = r.buffer.param_unpadded_start[r.param] + r.start
            n = r.end - r.start
            r.main.copy_(world["param"][at : at + n])
            if r.main is not r.model:
                r.model.copy_(r.main)
            if step.item() > 0:
                moments = {k: world[k][at : at + n].clone().to(r.main.device) for k in STATE_KEYS}
                self.optimizer.state[r.main] = {"step": step.clone(), **moments}
