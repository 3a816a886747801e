"""Pipeline p2p through shared memory, for CPU stages that share one host.

gloo moves a tensor between two processes on one machine through a loopback TCP socket: the bytes
are copied into the kernel and out again, and gloo's transport threads are woken on both sides, for
a CPU cost several times the copy's (bench/pipeline_stage_breakdown.py shows it as "other threads"
and kernel time). Here each ordered pair of neighbouring ranks gets a channel instead: a ring of
``SLOTS`` buffers in a shared-memory file that the sender copies into and the receiver copies out of,
and two FIFOs that carry an 8-byte size per message ("filled", sender to receiver) and a token per
buffer handed back ("free", receiver to sender). A message is one copy each side and a few small
syscalls; a send completes once copied, unless the ring is full.

Messages on a channel arrive in the order they were sent, as gloo matches them between a pair.
A receiver expects the byte count of the tensor it was asked for; a different count from the sender
is an error, not a misread. A channel's buffers start empty; at the first message larger than them
both sides move to a new ring after the old one in the file (messages still in the old ring stay put,
so growing never waits). A peer that exits closes its ends of the FIFOs, so its neighbours' next
receive or send raises instead of waiting forever (a message its sender left before exiting is still
received whole); a peer that is alive but sends nothing fails a receive after the group's timeout
(--distributed-timeout-minutes), as gloo would. Names in the shared-memory folder live only while the
group sets up: once every rank has opened its neighbours' ends, each rank unlinks the names it made.

``MEGATRON_LITE_P2P_SHARED_MEMORY=0`` keeps gloo's sockets.
"""

from __future__ import annotations

import atexit
import fcntl
import mmap
import os
import select
import struct
import tempfile
import uuid

import torch
import torch.distributed as dist

from megatron_lite.core import parallel_state

SLOTS = 4  # buffers per channel: a sender may run this many messages ahead of its receiver
ENV_SWITCH = "MEGATRON_LITE_P2P_SHARED_MEMORY"
_SIZE = struct.Struct("<q")
_PAGE = mmap.PAGESIZE
_setups: dict = {}  # process group -> SharedMemoryChannels, or None where gloo's sockets stay


def shared_memory_folder() -> str:
    """Where channel files go: the RAM-backed /dev/shm on Linux, else the temporary folder."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _Channel:
    """One direction between two ranks: the sender's or the receiver's end. Both ends hold the
    buffer file open (it has no name once set up), so growing it needs no new file."""

    def __init__(self, base: str, sending: bool, timeout_s: float):
        self.base, self.sending, self.timeout_s = base, sending, timeout_s
        self.buffer_fd = self.filled_fd = self.free_fd = -1
        self.ring_start, self.slot_bytes, self.index, self.in_flight = 0, 0, 0, 0
        self.buffer = None

    def _grow(self, nbytes: int, peer: int) -> None:
        """A ring for messages of ``nbytes`` after the current one: the sender allocates it before
        it sends the message's size, the receiver maps it when it reads that size."""
        self.ring_start += SLOTS * self.slot_bytes
        self.slot_bytes, self.index = -(-nbytes // _PAGE) * _PAGE, 0
        if self.sending:
            _allocate(self.buffer_fd, self.ring_start, SLOTS * self.slot_bytes, peer)
        end = self.ring_start + SLOTS * self.slot_bytes
        # The old mapping goes when the last view of it does.
        self.buffer = torch.frombuffer(mmap.mmap(self.buffer_fd, end), dtype=torch.uint8)

    def _slot(self, nbytes: int) -> torch.Tensor:
        start = self.ring_start + self.index * self.slot_bytes
        self.index = (self.index + 1) % SLOTS
        return self.buffer[start : start + nbytes]

    def send(self, tensor: torch.Tensor, peer: int) -> None:
        """Copy ``tensor`` (contiguous) into the ring; waits only while all SLOTS are unread."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.in_flight == SLOTS:
            self._take_free(peer)
        if nbytes > self.slot_bytes:
            self._grow(nbytes, peer)
        if nbytes:
            self._slot(nbytes).view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.in_flight += 1
        _write(self.filled_fd, _SIZE.pack(nbytes), peer)

    def _take_free(self, peer: int) -> None:
        _read(self.free_fd, 1, peer, self.timeout_s)
        self.in_flight -= 1

    def recv(self, tensor: torch.Tensor, peer: int) -> None:
        """Copy the next message into ``tensor`` (contiguous), which must have its byte count."""
        nbytes = tensor.numel() * tensor.element_size()
        (sent,) = _SIZE.unpack(_read(self.filled_fd, _SIZE.size, peer, self.timeout_s))
        if sent > self.slot_bytes:
            self._grow(sent, peer)
        if sent != nbytes:
            raise RuntimeError(
                f"pipeline p2p: rank {peer} sent {sent} bytes where this rank expects {nbytes}"
                f" ({tuple(tensor.shape)} {tensor.dtype}): the stages disagree on the tensor shape"
            )
        if nbytes:
            with torch.no_grad():  # the destination is a leaf that requires grad
                tensor.view(-1).view(torch.uint8).copy_(self._slot(nbytes))
        try:
            os.write(self.free_fd, b"f")
        except BrokenPipeError:
            pass  # the sender has finished and gone: it needs no buffer back, the message is whole

    def close(self) -> None:
        for fd in (self.buffer_fd, self.filled_fd, self.free_fd):
            if fd >= 0:
                os.close(fd)
        self.buffer_fd = self.filled_fd = self.free_fd = -1


def _allocate(fd: int, offset: int, size: int, peer: int) -> None:
    """Give the buffer file ``size`` bytes of memory at ``offset`` now: a full tmpfs (Docker's
    default /dev/shm is 64 MiB) then fails here, with a remedy, instead of killing the process with
    SIGBUS when a copy first touches a page it cannot have."""
    try:
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, offset, size)
        else:
            os.ftruncate(fd, offset + size)
    except OSError as error:
        raise RuntimeError(
            f"pipeline p2p: no room in {shared_memory_folder()} for {size / 2**20:.2f} MiB of buffers"
            f" to rank {peer} ({error.strerror}); enlarge it (docker run --shm-size ...) or set"
            f" {ENV_SWITCH}=0 to send over gloo's sockets"
        ) from None


def _peer_gone(peer: int) -> str:
    # The launcher knows this phrase: a symptom of the neighbour's failure, not the cause.
    return f"pipeline p2p: rank {peer} closed its shared-memory channel (it exited)"


def _read(fd: int, n: int, peer: int, timeout_s: float) -> bytes:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(timeout_s * 1000):  # neither data nor a closed writer (POLLHUP)
        raise RuntimeError(
            f"pipeline p2p: nothing from rank {peer} in {timeout_s / 60:g} minutes (timed out;"
            " --distributed-timeout-minutes sets how long a stage waits)"
        )
    data = os.read(fd, n)
    if len(data) != n:
        raise RuntimeError(_peer_gone(peer))
    return data


def _write(fd: int, data: bytes, peer: int) -> None:
    try:
        os.write(fd, data)
    except BrokenPipeError:
        raise RuntimeError(_peer_gone(peer)) from None


def _blocking(fd: int) -> None:
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)


class SharedMemoryChannels:
    """This rank's channels to and from its neighbours ``peers`` (global ranks) in one group."""

    def __init__(self, token: str, rank: int, peers, timeout_s: float):
        self.token = token  # in every name of this group's channels
        folder = shared_memory_folder()
        name = lambda src, dst: os.path.join(folder, f"megatron_lite_p2p_{token}_{src}_{dst}")  # noqa: E731
        self.outgoing = {p: _Channel(name(rank, p), True, timeout_s) for p in peers}
        self.incoming = {p: _Channel(name(p, rank), False, timeout_s) for p in peers}
        # The names this rank makes: each FIFO by its reader ("filled" for an incoming channel,
        # "free" for an outgoing one), each buffer file by its sender.
        self._made = [c.base + ".filled" for c in self.incoming.values()]
        self._made += [c.base + ".free" for c in self.outgoing.values()]
        self._made += [c.base for c in self.outgoing.values()]

    def make_own_ends(self) -> None:
        """Make this rank's names and open what it reads (the FIFOs without waiting for a writer)."""
        for c in self.outgoing.values():
            c.buffer_fd = os.open(c.base, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.mkfifo(c.base + ".free", 0o600)
            c.free_fd = os.open(c.base + ".free", os.O_RDONLY | os.O_NONBLOCK)
        for c in self.incoming.values():
            os.mkfifo(c.base + ".filled", 0o600)
            c.filled_fd = os.open(c.base + ".filled", os.O_RDONLY | os.O_NONBLOCK)

    def open_neighbours_ends(self) -> bool:
        """Open the names the neighbours made; False where they cannot be (another host or another
        /dev/shm: not there; or no reader on a FIFO)."""
        try:
            for c in self.outgoing.values():
                c.filled_fd = os.open(c.base + ".filled", os.O_WRONLY | os.O_NONBLOCK)
            for c in self.incoming.values():
                c.buffer_fd = os.open(c.base, os.O_RDWR)
                c.free_fd = os.open(c.base + ".free", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        return True

    def finish(self) -> None:
        """Every rank has opened every end: the names can go, and reads and writes block from now on."""
        self.unlink_made()
        for c in [*self.outgoing.values(), *self.incoming.values()]:
            for fd in (c.filled_fd, c.free_fd):
                _blocking(fd)

    def unlink_made(self) -> None:
        for path in self._made:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.unlink_made()
        for c in [*self.outgoing.values(), *self.incoming.values()]:
            c.close()


def _group_timeout_s(pp_group) -> float:
    """The group's collective timeout (upstream sets it from --distributed-timeout-minutes)."""
    try:
        return pp_group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):  # not exposed by this torch build: gloo's default
        return dist.default_pg_timeout.total_seconds()


def release_shared_memory_channels() -> None:
    """Close every group's channels and forget them (registered below with parallel_state, whose
    destroy_model_parallel calls it): a later communicator for a new group sets up its own."""
    for channels in _setups.values():
        if channels is not None:
            atexit.unregister(channels.close)
            channels.close()
    _setups.clear()


parallel_state.register_destroy_hook(release_shared_memory_channels)


def shared_memory_channels(pp_group, neighbours) -> SharedMemoryChannels | None:
    """This rank's shared-memory channels to ``neighbours`` (global ranks) in ``pp_group``, or None
    where gloo's sockets stay (NCCL, switched off, a platform without FIFOs, or a rank that cannot
    open a neighbour's channel files: another host or another /dev/shm). Made once per group.

    Collective over ``pp_group`` the first time it is called for the group (a token, then whether
    every rank opened its channels); later calls return the same channels without communicating.
    """
    if pp_group in _setups:
        return _setups[pp_group]
    if dist.get_backend(pp_group) != "gloo":
        return None  # NCCL, or the preflight's fake world: the same backend on every rank, no collective
    peers = sorted(set(neighbours) - {dist.get_rank()})
    usable = bool(peers) and os.environ.get(ENV_SWITCH, "1") != "0" and hasattr(os, "mkfifo")
    # Every rank of the group must take the same path through the collectives below.
    agreed = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(agreed, (usable, uuid.uuid4().hex), group=pp_group)
    channels = None
    if all(ok for ok, _ in agreed):
        channels = SharedMemoryChannels(agreed[0][1], dist.get_rank(), peers, _group_timeout_s(pp_group))
        try:
            try:
                channels.make_own_ends()
                made = True
            except OSError:
                made = False
            dist.barrier(group=pp_group)  # every rank's names exist, its FIFOs open for reading
            opened = made and channels.open_neighbours_ends()
            dist.all_gather_object(agreed, opened, group=pp_group)
        except BaseException:  # a neighbour failed during set-up: leave no names behind
            channels.close()
            raise
        if all(agreed):
            channels.finish()
            atexit.register(channels.close)
        else:
            channels.close()
            channels = None
    _setups[pp_group] = channels
    return channels
