"""DistributedDataParallel: fp32 gradient buffers, averaged over the data-parallel group once per step.

Each parameter's gradient accumulates (over microbatches) into ``param.main_grad``, an fp32 view into
a contiguous bucket (fp32 parameters' ``.grad`` is that view; others add into it from a hook). Nothing is communicated during backward; ``finish_grad_sync`` all-reduces each
bucket once, after the last microbatch.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn


class _Bucket:
    def __init__(self, params: list[nn.Parameter], device: torch.device):
        self.params = params
        self.grad_data = torch.zeros(sum(p.numel() for p in params), dtype=torch.float32, device=device)
        offset = 0
        for p in params:
            p.main_grad = self.grad_data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


class DistributedDataParallel(nn.Module):
    """Wraps a model chunk; ``module`` is the wrapped model."""

    def __init__(self, config, module: nn.Module, *, dp_group=None, bucket_size: int | None = None):
        super().__init__()
        self.config = config
        self.module = module
        self.dp_group = dp_group
        dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        bucket_size = bucket_size or max(40_000_000, 1_000_000 * dp_size)
        params = [p for p in module.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        # Reverse order approximates the order gradients become ready in backward.
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        for p in reversed(params):
            current.append(p)
            if sum(q.numel() for q in current) >= bucket_size:
                self.buckets.append(_Bucket(current, device))
                current = []
        if current:
            self.buckets.append(_Bucket(current, device))
        for p in params:
            if p.dtype == torch.float32:
                # Autograd accumulates in place into an existing .grad: aliasing the buffer makes
                # every microbatch's gradient land in main_grad directly.
                p.grad = p.main_grad
            else:
                p.register_post_accumulate_grad_hook(self._accumulate)

    @staticmethod
    def _accumulate(param: nn.Parameter) -> None:
        param.main_grad.add_(param.grad)
        param.grad = None

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, input_tensor) -> None:
        self.module.set_input_tensor(input_tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients only accumulate locally in this context (they never sync before finish_grad_sync)."""
        yield

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Average the gradient buffers over the data-parallel group. Collective over ``dp_group``.
        Always an all-reduce (``force_all_reduce`` is accepted for upstream's signature)."""
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        scale = 1.0 / dist.get_world_size(self.dp_group)
        for bucket in self.buckets:
            bucket.grad_data.mul_(scale)
            dist.all_reduce(bucket.grad_data, group=self.dp_group)

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer (and re-alias fp32 .grad, in case something set it to None)."""
        for bucket in self.buckets:
            bucket.grad_data.zero_()
            for p in bucket.params:
                if p.dtype == torch.float32:
                    p.grad = p.main_grad

    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)
