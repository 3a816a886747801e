"""Point-to-point communication between adjacent pipeline stages.

``P2PCommunicator(pp_group, config)`` has Megatron core's named calls. Each takes the stage flag
(``is_first_stage`` / ``is_last_stage``) the schedule passes, as upstream does; where the stage has no
neighbour in that direction the call does nothing and returns None, so schedules never branch on
the stage. A call accepts one tensor/shape or a list of them (one exchange each). Sends and receives
of one call are posted together (``batch_isend_irecv`` on NCCL) and its receives are waited on before
it returns. On gloo (CPU) a send completes only once the peer has posted the matching receive, so
waiting for it would stall this stage's next compute behind the neighbour's; there the communicator
keeps each send (and a reference to its tensor, so freeing the caller's output is safe) and waits for
it at the start of its next exchange or in ``wait_for_sends``, which a schedule calls before it
returns. Values and message order are unchanged: only where this rank waits moves. Between gloo stages
on one host, messages go through shared memory instead of gloo's sockets (shared_memory_p2p.py): the
same messages in the same order, one copy each side, a send complete once copied.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.pipeline_parallel.shared_memory_p2p import shared_memory_channels
from megatron_lite.core.pipeline_parallel.utils import is_pp_first_stage, is_pp_last_stage


def is_single_shape(x) -> bool:
    """Whether ``x`` is one tensor shape (a torch.Size or a sequence of ints), not a list of shapes."""
    if isinstance(x, torch.Size):
        return True
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(isinstance(d, int) for d in x)


def _as_list(x) -> tuple[list, bool]:
    """``x`` as a list, and whether it was a single item (so the result is unwrapped again)."""
    return (x, False) if isinstance(x, list) else ([x], True)


def wait_for_sends(p2p_communicator) -> None:
    """Complete a communicator's sends still in flight (ours defers gloo's; a communicator without
    ``wait_for_sends`` waited for them in each exchange)."""
    wait = getattr(p2p_communicator, "wait_for_sends", None)
    if wait is not None:
        wait()


class P2PCommunicator:
    """Sends and receives activations (forward) and their gradients (backward) over ``pp_group``.
    The first one built for a gloo group is collective over it (setting up shared memory)."""

    def __init__(self, pp_group, config):
        self.pp_group = pp_group
        self.config = config
        ranks = dist.get_process_group_ranks(pp_group)
        stage = ranks.index(dist.get_rank())
        # As upstream, neighbours wrap around; the stage flags keep the ends from using them.
        self.next_rank: int | None = ranks[(stage + 1) % len(ranks)]
        self.prev_rank: int | None = ranks[(stage - 1) % len(ranks)]
        self.virtual_pipeline_model_parallel_size = getattr(
            config, "virtual_pipeline_model_parallel_size", None
        )
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend(pp_group) == "nccl"
            else torch.device("cpu")
        )
        # gloo sends still in flight, each with the tensor it sends (kept alive until complete).
        self._pending_sends: list[tuple[object, torch.Tensor]] = []
        # gloo's sends wait for the peer (see the module's docstring); NCCL's, and a fake world's (the
        # preflight's dry run, which stands for a GPU job), are batched and complete with the exchange.
        self._defers_sends = dist.get_backend(pp_group) == "gloo"
        self._shared_memory = (
            shared_memory_channels(pp_group, (self.next_rank, self.prev_rank)) if self._defers_sends else None
        )

    def wait_for_sends(self) -> None:
        """Wait until every send this communicator posted has completed (the peers received them)."""
        pending = getattr(self, "_pending_sends", [])  # none in a subclass that skips __init__
        for request, _ in pending:
            request.wait()
        pending.clear()  # (a send through shared memory is complete once copied: nothing to wait for)

    @property
    def is_pp_first_stage(self) -> bool:
        return is_pp_first_stage(self.pp_group)

    @property
    def is_pp_last_stage(self) -> bool:
        return is_pp_last_stage(self.pp_group)

    @property
    def total_stages(self) -> int:
        return dist.get_world_size(self.pp_group)

    @property
    def current_stage(self) -> int:
        return dist.get_rank(self.pp_group)

    def _communicate(
        self,
        *,
        tensor_send_next=None,
        tensor_send_prev=None,
        recv_prev=False,
        recv_next=False,
        tensor_shape=None,
    ):
        """One batched exchange with the neighbours; returns (from previous, from next)."""
        if (recv_prev or recv_next) and getattr(self.config, "variable_seq_lengths", False):
            raise NotImplementedError(
                "variable_seq_lengths (shapes exchanged per microbatch) is not supported"
            )
        dtype = getattr(self.config, "pipeline_dtype", None)
        if (recv_prev or recv_next) and (dtype is None or tensor_shape is None):
            raise RuntimeError(
                "receiving needs config.pipeline_dtype and a tensor_shape (seq, micro batch, hidden)"
            )

        def empty():
            # Received activations are leaves of this stage's graph: they need grads for backward.
            return torch.empty(tensor_shape, dtype=dtype, device=self.device, requires_grad=True)

        from_prev = empty() if recv_prev else None
        from_next = empty() if recv_next else None
        # Activations (to next, from prev) before gradients (to prev, from next): with two stages the
        # previous and next rank are the same peer, and messages between a pair match in posting
        # order, so both ranks must post the two directions in the same order.
        ops = []
        if tensor_send_next is not None:
            ops.append(dist.P2POp(dist.isend, tensor_send_next.contiguous(), self.next_rank, self.pp_group))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.pp_group))
        if tensor_send_prev is not None:
            ops.append(dist.P2POp(dist.isend, tensor_send_prev.contiguous(), self.prev_rank, self.pp_group))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.pp_group))
        shm = getattr(self, "_shared_memory", None)  # none in a subclass that skips __init__
        if ops and shm is not None:
            # Sends first: they wait only while a ring's buffers are all unread (a gloo exchange
            # waits for all of its previous sends), so receiving after them cannot deadlock.
            for op in sorted(ops, key=lambda op: op.op is not dist.isend):
                if op.op is dist.isend:
                    shm.outgoing[op.peer].send(op.tensor, op.peer)
                else:
                    shm.incoming[op.peer].recv(op.tensor, op.peer)
        elif ops and not getattr(self, "_defers_sends", self.device.type == "cpu"):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        elif ops:
            self.wait_for_sends()  # the previous exchange's sends had this rank's compute to finish
            receives = []
            for op in ops:  # posted one by one, in the same order: gloo has no batched p2p
                request = op.op(op.tensor, op.peer, op.group)
                if op.op is dist.isend:
                    self._pending_sends.append((request, op.tensor))
                else:
                    receives.append(request)
            for request in receives:
                request.wait()
        return from_prev, from_next

    def _first(self, is_first_stage):
        return self.is_pp_first_stage if is_first_stage is None else is_first_stage

    def _last(self, is_last_stage):
        return self.is_pp_last_stage if is_last_stage is None else is_last_stage

    def recv_forward(self, tensor_shapes, is_first_stage: bool | None = None):
        """Receive the previous stage's output (None on the first stage)."""
        if is_single_shape(tensor_shapes):
            return self.recv_forward([tensor_shapes], is_first_stage)[0]
        if self._first(is_first_stage):
            return [None for _ in tensor_shapes]
        return [self._communicate(recv_prev=True, tensor_shape=s)[0] for s in tensor_shapes]

    def recv_backward(self, tensor_shapes, is_last_stage: bool | None = None):
        """Receive the gradient of this stage's output (None on the last stage)."""
        if is_single_shape(tensor_shapes):
            return self.recv_backward([tensor_shapes], is_last_stage)[0]
        if self._last(is_last_stage):
            return [None for _ in tensor_shapes]
        return [self._communicate(recv_next=True, tensor_shape=s)[1] for s in tensor_shapes]

    def send_forward(self, output_tensors, is_last_stage: bool | None = None) -> None:
        """Send this stage's output to the next stage (nothing on the last stage)."""
        if self._last(is_last_stage):
            return
        for tensor in _as_list(output_tensors)[0]:
            self._communicate(tensor_send_next=tensor.detach())

    def send_backward(self, input_tensor_grads, is_first_stage: bool | None = None) -> None:
        """Send the gradient of this stage's input to the previous stage (nothing on the first stage)."""
        if self._first(is_first_stage):
            return
        for grad in _as_list(input_tensor_grads)[0]:
            self._communicate(tensor_send_prev=grad)

    def send_forward_recv_backward(self, output_tensors, tensor_shapes, is_last_stage: bool | None = None):
        """Send the output forward and receive its gradient, as one batched exchange per tensor."""
        tensors, single = _as_list(output_tensors)
        shapes = [tensor_shapes] if is_single_shape(tensor_shapes) else tensor_shapes
        if self._last(is_last_stage):
            grads = [None for _ in shapes]
        else:
            grads = [
                self._communicate(tensor_send_next=t.detach(), recv_next=True, tensor_shape=s)[1]
                for t, s in zip(tensors, shapes)
            ]
        return grads[0] if single else grads

    def send_backward_recv_forward(
        self, input_tensor_grads, tensor_shapes, is_first_stage: bool | None = None
    ):
        """Send the input gradient back and receive the next input, as one batched exchange per tensor."""
        grads, single = _as_list(input_tensor_grads)
        shapes = [tensor_shapes] if is_single_shape(tensor_shapes) else tensor_shapes
        if self._first(is_first_stage):
            inputs = [None for _ in shapes]
        else:
            inputs = [
                self._communicate(tensor_send_prev=g, recv_prev=True, tensor_shape=s)[0]
                for g, s in zip(grads, shapes)
            ]
        return inputs[0] if single else inputs

    # The interleaved schedule's calls: explicit receive flags, since with virtual stages the first
    # and last pipeline ranks also exchange with each other (the ring wraps around).

    def send_forward_recv_forward(self, output_tensor, recv_prev: bool, tensor_shape, overlap_p2p_comm=False):
        """Send ``output_tensor`` (if any) to the next rank and, if ``recv_prev``, receive from the previous."""
        if overlap_p2p_comm:
            raise NotImplementedError("overlap_p2p_comm is not supported by megatron_lite")
        send = None if output_tensor is None else output_tensor.detach()
        return self._communicate(tensor_send_next=send, recv_prev=recv_prev, tensor_shape=tensor_shape)[0]

    def send_backward_recv_backward(
        self, input_tensor_grad, recv_next: bool, tensor_shape, overlap_p2p_comm=False
    ):
        """Send ``input_tensor_grad`` (if any) to the previous rank and, if ``recv_next``, receive from the next."""
        if overlap_p2p_comm:
            raise NotImplementedError("overlap_p2p_comm is not supported by megatron_lite")
        return self._communicate(
            tensor_send_prev=input_tensor_grad, recv_next=recv_next, tensor_shape=tensor_shape
        )[1]

    def send_forward_backward_recv_forward_backward(
        self, output_tensor, input_tensor_grad, recv_prev: bool, recv_next: bool, tensor_shape
    ):
        """Both directions in one batched exchange; returns (input from previous, output grad from next)."""
        send = None if output_tensor is None else output_tensor.detach()
        return self._communicate(
            tensor_send_next=send,
            tensor_send_prev=input_tensor_grad,
            recv_prev=recv_prev,
            recv_next=recv_next,
            tensor_shape=tensor_shape,
        )
