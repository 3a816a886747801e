"""DistributedDataParallel: fp32 gradient buffers in buckets, averaged over the data-parallel group.

Each parameter's gradient accumulates (over microbatches) into ``param.main_grad``, an fp32 view into
a bucket of a contiguous buffer (param_and_grad_buffer.py; fp32 parameters' ``.grad`` is that view,
others add into it from a hook). Without ``overlap_grad_reduce`` every bucket is reduced in
``finish_grad_sync`` after the last microbatch; with it, a bucket's reduction starts asynchronously
from the gradient hook as soon as its last gradient of the last microbatch is final, and
``finish_grad_sync`` only waits. With the distributed optimizer the reduction is a reduce-scatter and
parameters live in a buffer too, refreshed by ``start_param_sync`` (with ``overlap_param_gather``
asynchronously, waited for in a forward pre-hook of the modules that use them).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer


class DistributedDataParallel(nn.Module):
    """Wraps a model chunk; ``module`` is the wrapped model. ``ddp_config`` reads upstream's
    ``overlap_grad_reduce``, ``overlap_param_gather``, ``use_distributed_optimizer``, ``bucket_size``."""

    def __init__(
        self,
        config,
        module: nn.Module,
        *,
        dp_group=None,
        bucket_size=None,
        ddp_config=None,
        expt_dp_group=None,
    ):
        """A MoE model's routed experts (``allreduce`` False) get buffers of their own, reduced over
        ``expt_dp_group`` and scaled like the rest by 1 / dp (megatron-core's expert gradient scaling:
        an expert already summed the gradients of the tokens every expert-parallel rank sent it)."""
        super().__init__()
        self.config = config
        self.module = module
        self.dp_group = dp_group
        self.expt_dp_group = expt_dp_group
        self.overlap_grad_reduce = bool(getattr(ddp_config, "overlap_grad_reduce", False))
        self.overlap_param_gather = bool(getattr(ddp_config, "overlap_param_gather", False))
        self.use_distributed_optimizer = bool(getattr(ddp_config, "use_distributed_optimizer", False))
        if self.overlap_grad_reduce and getattr(config, "defer_embedding_wgrad_compute", False):
            raise ValueError(
                "overlap_grad_reduce cannot be combined with defer_embedding_wgrad_compute: the output "
                "layer's bucket would be reduced before its deferred weight gradients are added"
            )
        dp_size = 1 if dp_group is None else dist.get_world_size(dp_group)
        # Per-token loss (as upstream): gradients are summed over ranks here and divided by the step's
        # token count in finalize_model_grads, instead of averaged over dp.
        scaling = 1.0 if getattr(config, "calculate_per_token_loss", False) else 1.0 / dp_size
        bucket_size = bucket_size or getattr(ddp_config, "bucket_size", None)
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * dp_size)  # upstream's default
        if not self.overlap_grad_reduce:
            bucket_size = None  # as upstream: nothing to overlap, so one bucket per buffer
        params = [p for p in module.parameters() if p.requires_grad]
        by_kind: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
        for p in params:
            by_kind.setdefault((not getattr(p, "allreduce", True), p.dtype), []).append(p)
        self.buffers = [
            _ParamAndGradBuffer(
                group,
                dp_group=expt_dp_group if expert else dp_group,
                bucket_size=bucket_size,
                use_distributed_optimizer=self.use_distributed_optimizer,
                gradient_scaling_factor=scaling,
            )
            for (expert, _), group in sorted(by_kind.items(), key=lambda kv: kv[0][0])
        ]
        self.buckets = [b for buf in self.buffers for b in buf.buckets]
        self._buffer_of = {p: buf for buf in self.buffers for p in buf.param_index_map}
        self._sync_enabled = True
        for p in params:
            if p.dtype == torch.float32:
                # Autograd accumulates in place into an existing .grad: aliasing the buffer makes
                # every microbatch's gradient land in main_grad directly.
                p.grad = p.main_grad
                # Nothing waits on its gradient hook: a backward may add straight into main_grad
                # (tensor_parallel/embedding_grad.py).
                p.main_grad_is_grad = not self.overlap_grad_reduce
            p.register_post_accumulate_grad_hook(self._grad_hook)
        if self.overlap_param_gather:
            for sub in module.modules():
                own = [p for p in sub.parameters(recurse=False) if p in self._buffer_of]
                if own:
                    sub.register_forward_pre_hook(self._param_gather_hook(own))

    def _grad_hook(self, param: nn.Parameter) -> None:
        # No .grad when a backward deferred this weight's gradient (linear_wgrad adds it later) or
        # added it into main_grad itself (gradient-accumulation fusion): autograd still calls this hook.
        if param.dtype != torch.float32 and param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None
        if self.overlap_grad_reduce and self._sync_enabled:
            self._buffer_of[param].register_grad_ready(param, async_op=True)

    def _param_gather_hook(self, params):
        buckets = []
        for p in params:
            if not any(b is self._bucket_of(p) for b in buckets):
                buckets.append(self._bucket_of(p))

        def hook(_module, _args):
            for bucket in buckets:
                bucket.finish_param_sync()

        return hook

    def _bucket_of(self, param):
        buf = self._buffer_of[param]
        return buf.buckets[buf.param_index_map[param][2]]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def set_input_tensor(self, input_tensor) -> None:
        self.module.set_input_tensor(input_tensor)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients only accumulate locally in this context: the overlap hooks start nothing."""
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = True

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Average the gradient buffers over the data-parallel group (start what the hooks did not,
        wait for all). Collective over ``dp_group``. With the distributed optimizer only this rank's
        shard of each bucket is reduced, unless ``force_all_reduce`` (for buckets not already
        started by the overlap hooks), as upstream."""
        for bucket in self.buckets:
            bucket.finish_grad_sync(force_all_reduce=bool(force_all_reduce))

    def scale_gradients(self, scaling_factor) -> None:
        """Multiply every gradient buffer by ``scaling_factor`` (a number or a 0-d tensor), in place:
        finalize_model_grads' division by the step's tokens with per-token loss."""
        for buffer in self.buffers:
            buffer.grad_data.mul_(scaling_factor)

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather the parameter shards (distributed optimizer), asynchronously with
        ``overlap_param_gather`` unless ``force_sync``. Collective over ``dp_group``."""
        async_op = self.overlap_param_gather and not force_sync
        for bucket in self.buckets:
            bucket.start_param_sync(async_op=async_op)

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather."""
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def zero_grad_buffer(self) -> None:
        """Zero every gradient buffer (and re-alias fp32 .grad, in case something set it to None)."""
        for bucket in self.buckets:
            bucket.grad_data.zero_()
            bucket.reset()
            for p in bucket.params:
                if p.dtype == torch.float32:
                    p.grad = p.main_grad

    def state_dict(self, *args, **kwargs):
        self.finish_param_sync()  # pending all-gathers would leave stale shards in the copy
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True):
        self.finish_param_sync()
        return self.module.load_state_dict(state_dict, strict=strict)
