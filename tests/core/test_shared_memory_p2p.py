"""Pipeline p2p through shared memory between CPU stages on one host, in real gloo worlds."""

from __future__ import annotations

import glob
import mmap
import os
import time

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.core.pipeline_parallel import shared_memory_p2p
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.models.gpt_provider import GPTModelProvider


def _communicator(group=None):
    cfg = GPTModelProvider(num_layers=4, hidden_size=8, num_attention_heads=2)
    return P2PCommunicator(group or dist.new_group(list(range(dist.get_world_size()))), cfg)


def _channel_names(p2p) -> list[str]:
    """The names in the shared-memory folder of this communicator's group."""
    if p2p._shared_memory is None:
        return []
    folder, token = shared_memory_p2p.shared_memory_folder(), p2p._shared_memory.token
    return glob.glob(os.path.join(folder, f"megatron_lite_p2p_{token}_*"))


def _relay(rank, world, switched_off):
    """Messages of growing and shrinking sizes, more of them than a ring holds, forward along the
    pipeline and back; returns what this rank received and whether it used shared memory."""
    if switched_off:
        os.environ[shared_memory_p2p.ENV_SWITCH] = "0"
    p2p = _communicator()
    dist.barrier()  # every rank has finished setting up (and unlinked its names)
    names_after_setup = _channel_names(p2p)
    shapes = [(3, 2, 8), (3, 2, 8), (64, 2, 8), (1, 2, 8), (64, 2, 8), (128, 2, 8)] * 2
    received = []
    for i, shape in enumerate(shapes):
        payload = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape) + 1000 * i
        incoming = p2p.recv_forward(shape)
        received.append(None if incoming is None else torch.equal(incoming, payload + rank - 1))
        p2p.send_forward(payload + rank)
        assert incoming is None or incoming.requires_grad  # a leaf of this stage's graph
    grads = []
    for i, shape in enumerate(shapes):
        grad = p2p.recv_backward(shape)
        grads.append(None if grad is None else float(grad.detach().sum()))
        p2p.send_backward(torch.full(shape, float(rank + i)))
    p2p.wait_for_sends()
    dist.barrier()
    return received, grads, p2p._shared_memory is not None, names_after_setup, _channel_names(p2p)


@pytest.mark.world
@pytest.mark.parametrize("switched_off", [False, True], ids=["shared-memory", "gloo"])
def test_stages_relay_every_message_exactly(switched_off):
    results = run_world(_relay, 3, switched_off)
    shapes = [(3, 2, 8), (3, 2, 8), (64, 2, 8), (1, 2, 8), (64, 2, 8), (128, 2, 8)] * 2
    for rank, (received, grads, shared, names, names_at_end) in enumerate(results):
        assert shared is not switched_off
        assert received == ([None] * len(shapes) if rank == 0 else [True] * len(shapes))
        if rank == 2:
            assert grads == [None] * len(shapes)
        else:
            sender = rank + 1
            assert grads == [float((sender + i) * torch.Size(s).numel()) for i, s in enumerate(shapes)]
        assert names == []  # channel names are unlinked once every end is open
        assert names_at_end == []  # growing a ring made no new name


def _mismatch(rank, world):
    p2p = _communicator()
    if rank == 0:
        p2p.send_forward(torch.ones(4, 2, 8))
        return None
    with pytest.raises(RuntimeError, match="rank 0 sent 256 bytes where this rank expects 512"):
        p2p.recv_forward((8, 2, 8))
    return "raised"


@pytest.mark.world
def test_stages_that_disagree_on_the_shape_get_an_error():
    assert run_world(_mismatch, 2) == [None, "raised"]


def _peer_closes(rank, world):
    p2p = _communicator()
    if rank == 1:
        p2p._shared_memory.close()  # what the kernel does to a rank that exits or crashes
        dist.barrier()
        return None
    dist.barrier()  # rank 1's ends are all closed
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 closed its shared-memory channel"):
        p2p.recv_backward((3, 2, 8))
    with pytest.raises(RuntimeError, match="rank 1 closed its shared-memory channel"):
        p2p.send_forward(torch.ones(3, 2, 8))
    return time.monotonic() - start


@pytest.mark.world
def test_a_peer_that_goes_away_fails_its_neighbours_calls_instead_of_hanging():
    assert run_world(_peer_closes, 2, timeout=60)[0] < 30


def _one_step(world, switched_off):
    """One 1F1B forward-backward of a tiny GPT from fixed weights: this stage's loss and gradients."""
    from megatron_lite.core import parallel_state as ps
    from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset
    from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron_lite.core.pipeline_parallel import get_forward_backward_func
    from megatron_lite.data.samplers import build_pretraining_data_loader
    from megatron_lite.training.config import ConfigContainer
    from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.state import GlobalState

    os.environ[shared_memory_p2p.ENV_SWITCH] = "0" if switched_off else "1"
    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    torch.manual_seed(0)
    cfg = GPTModelProvider(
        num_layers=world, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
        max_position_embeddings=16, pipeline_model_parallel_size=world,
    )  # fmt: skip
    model = DistributedDataParallel(cfg, cfg.provide(), dp_group=ps.get_data_parallel_group())
    cfg.finalize_model_grads_func = finalize_model_grads
    data = MockGPTDataset(vocab_size=128, sequence_length=16, seed=3, num_samples=64)
    losses = get_forward_backward_func()(
        forward_step_func=prepare_forward_step_func(forward_step, GlobalState(ConfigContainer())),
        data_iterator=iter(build_pretraining_data_loader(data, 0, 2, 0, 1)),
        model=[model],
        num_microbatches=6,
        seq_length=16,
        micro_batch_size=2,
    )
    shared = P2PCommunicator(ps.get_pipeline_model_parallel_group(), cfg)._shared_memory is not None
    grads = [p.main_grad.tolist() for p in model.parameters()]  # lists: exact, and picklable
    ps.destroy_model_parallel()
    return [d["lm loss"].tolist() for d in losses], grads, shared


def _both_transports(rank, world):
    return _one_step(world, switched_off=False), _one_step(world, switched_off=True)


@pytest.mark.world
def test_losses_and_gradients_are_bitwise_those_over_gloos_sockets():
    results = run_world(_both_transports, 3)
    assert len(results[-1][0][0]) == 6  # the last stage's microbatch losses
    for shm, sockets in results:
        assert shm[2] and not sockets[2]
        assert len(shm[0]) == len(sockets[0])  # 6 microbatches' losses on the last stage, none elsewhere
        assert shm[0] == sockets[0]
        assert len(shm[1]) == len(sockets[1]) > 0
        assert shm[1] == sockets[1]


def _channel_pair(tmp_path):
    """The two ends of one channel in this process: a buffer file and two pipes for the FIFOs."""
    base = str(tmp_path / "channel")
    sender = shared_memory_p2p._Channel(base, sending=True, timeout_s=10)
    receiver = shared_memory_p2p._Channel(base, sending=False, timeout_s=10)
    sender.buffer_fd = os.open(base, os.O_RDWR | os.O_CREAT, 0o600)
    receiver.buffer_fd = os.open(base, os.O_RDWR)
    receiver.filled_fd, sender.filled_fd = os.pipe()
    sender.free_fd, receiver.free_fd = os.pipe()
    return sender, receiver


def test_a_channel_wraps_its_ring_and_grows_in_place(tmp_path):
    sender, receiver = _channel_pair(tmp_path)
    for size in (5, 5, 5, 5, 5, 3000, 7, 3000):  # more messages than slots; a larger one mid-way
        sent = [torch.randn(size) for _ in range(shared_memory_p2p.SLOTS)]
        for t in sent:
            sender.send(t, peer=1)
        for t in sent:
            out = torch.empty(size)
            receiver.recv(out, peer=0)
            assert torch.equal(out, t)
    # One ring per size that grew it, each after the last: 5 floats, then 3000 (whole pages each).
    pages = [-(-n // mmap.PAGESIZE) * mmap.PAGESIZE for n in (5 * 4, 3000 * 4)]
    assert os.fstat(sender.buffer_fd).st_size == shared_memory_p2p.SLOTS * sum(pages)
    sender.close(), receiver.close()


def test_a_full_shared_memory_folder_is_a_clear_error_not_a_sigbus(tmp_path, mocker):
    sender, receiver = _channel_pair(tmp_path)
    mocker.patch.object(os, "posix_fallocate", side_effect=OSError(28, "No space left on device"))
    with pytest.raises(
        RuntimeError,
        match=r"no room in .* for 0\.02 MiB of buffers to rank 1 \(No space left on device\); enlarge it",
    ):
        sender.send(torch.ones(4), peer=1)
    sender.close(), receiver.close()


def test_a_larger_message_while_the_ring_is_full_of_unread_ones_does_not_wait(tmp_path):
    sender, receiver = _channel_pair(tmp_path)
    small = [torch.randn(5) for _ in range(shared_memory_p2p.SLOTS - 1)]
    for t in small:
        sender.send(t, peer=1)
    big = torch.randn(5000)
    sender.send(big, peer=1)  # one thread: waiting for the receiver here would never return
    for t in [*small, big]:
        out = torch.empty(t.shape)
        receiver.recv(out, peer=0)
        assert torch.equal(out, t)
    sender.close(), receiver.close()


def _finished_sender(rank, world):
    p2p = _communicator()
    if rank == 0:
        p2p.send_forward(torch.ones(3, 2, 8))
        p2p._shared_memory.close()  # a sender that has finished its work and exited
        dist.barrier()
        return None
    dist.barrier()
    return float(p2p.recv_forward((3, 2, 8)).detach().sum())  # handing the buffer back finds no one


@pytest.mark.world
def test_a_message_from_a_sender_that_already_exited_is_still_received():
    assert run_world(_finished_sender, 2) == [None, 48.0]


def _silent_neighbour(rank, world):
    from datetime import timedelta

    p2p = _communicator(dist.new_group([0, 1], timeout=timedelta(seconds=2)))
    if rank == 1:
        with pytest.raises(RuntimeError, match=r"nothing from rank 0 in 0\.0333333 minutes \(timed out"):
            p2p.recv_forward((3, 2, 8))
    dist.barrier()  # rank 0 stays alive and silent until then
    return rank


@pytest.mark.world
def test_a_neighbour_that_sends_nothing_times_out_as_gloo_would():
    assert run_world(_silent_neighbour, 2, timeout=60) == [0, 1]


def _released(rank, world):
    from megatron_lite.core import parallel_state as ps

    ps.initialize_model_parallel(pipeline_model_parallel_size=world)
    channels = _communicator(ps.get_pipeline_model_parallel_group())._shared_memory
    fds = [c.filled_fd for c in channels.incoming.values()]
    ps.destroy_model_parallel()
    return [c.filled_fd for c in channels.incoming.values()], [_fd_open(fd) for fd in fds]


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.mark.world
def test_destroying_the_groups_closes_their_channels():
    for fds_after, still_open in run_world(_released, 2):
        assert fds_after == [-1] and still_open == [False]
