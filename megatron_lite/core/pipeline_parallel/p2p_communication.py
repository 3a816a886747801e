"""Point-to-point communication between adjacent pipeline stages.

Six named calls, as in Megatron core. Each does nothing (returns None) where the stage has no
neighbour in that direction, so schedules never branch on the stage. Sends and receives of one call
are posted together with ``batch_isend_irecv`` and waited on before returning, so a sent tensor may be
freed as soon as the call returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.transformer.transformer_config import TransformerConfig


class P2PCommunicator:
    """Sends and receives activations (forward) and their gradients (backward) over ``pp_group``."""

    def __init__(self, pp_group, config: TransformerConfig):
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        stage = dist.get_rank(pp_group)
        self.is_first_stage = stage == 0
        self.is_last_stage = stage == len(ranks) - 1
        self.prev_rank = None if self.is_first_stage else ranks[stage - 1]
        self.next_rank = None if self.is_last_stage else ranks[stage + 1]
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(pp_group) == "nccl"
            else torch.device("cpu")
        )

    def _communicate(
        self, *, send_next=None, send_prev=None, recv_prev=False, recv_next=False, tensor_shape=None
    ):
        def empty():
            # Received activations are leaves of this stage's graph: they need grads for backward.
            return torch.empty(
                tensor_shape, dtype=self.config.pipeline_dtype, device=self.device, requires_grad=True
            )

        from_prev = empty() if recv_prev else None
        from_next = empty() if recv_next else None
        ops = []
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev_rank, self.pp_group))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.pp_group))
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next_rank, self.pp_group))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.pp_group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return from_prev, from_next

    def recv_forward(self, tensor_shape):
        """Receive the previous stage's output (None on the first stage)."""
        if self.is_first_stage:
            return None
        return self._communicate(recv_prev=True, tensor_shape=tensor_shape)[0]

    def send_forward(self, output_tensor) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if not self.is_last_stage:
            self._communicate(send_next=output_tensor.detach())

    def recv_backward(self, tensor_shape):
        """Receive the gradient of this stage's output (None on the last stage)."""
        if self.is_last_stage:
            return None
        return self._communicate(recv_next=True, tensor_shape=tensor_shape)[1]

    def send_backward(self, input_tensor_grad) -> None:
        """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if not self.is_first_stage:
            self._communicate(send_prev=input_tensor_grad)

    def send_forward_recv_backward(self, output_tensor, tensor_shape):
        """Send the output forward and receive its gradient, as one batched exchange."""
        if self.is_last_stage:
            return None
        return self._communicate(send_next=output_tensor.detach(), recv_next=True, tensor_shape=tensor_shape)[
            1
        ]

    def send_backward_recv_forward(self, input_tensor_grad, tensor_shape):
        """Send the input gradient back and receive the next input, as one batched exchange."""
        if self.is_first_stage:
            return None
        return self._communicate(send_prev=input_tensor_grad, recv_prev=True, tensor_shape=tensor_shape)[0]
