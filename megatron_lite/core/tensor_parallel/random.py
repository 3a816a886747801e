"""RNG streams for dropout under tensor parallelism, and activation checkpointing that replays them,
as megatron.core.tensor_parallel.random.

Dropout on activations that every tensor-parallel rank holds whole (hidden dropout) uses the default
generator, seeded alike on all TP ranks so they drop the same elements. Dropout inside the TP region
(attention probabilities of this rank's heads) runs under ``get_cuda_rng_tracker().fork()``, a stream
seeded differently per TP rank. The tracker swaps the CUDA generator's state when the model is on a
GPU and the CPU generator's otherwise, so the same code runs on both.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import detach_variable

from megatron_lite.core import parallel_state
from megatron_lite.core.tensor_parallel.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"
_DEFAULT_STATE_NAME = "default-rng"


def get_expert_parallel_rng_tracker_name() -> str:
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


def get_data_parallel_rng_tracker_name() -> str:
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def _use_cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _use_cuda() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if _use_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class CudaRNGStatesTracker:
    """Named RNG states; ``fork(name)`` runs a block on that stream and advances it. Forks nest: a
    fork inside a fork of another stream saves the outer stream's progress before switching."""

    def __init__(self, use_cudagraphable_rng: bool = False, is_inference_rng_tracker: bool = False) -> None:
        if use_cudagraphable_rng:
            raise NotImplementedError("CUDA-graph-safe RNG states are not supported by megatron_lite")
        self.use_cudagraphable_rng = use_cudagraphable_rng
        self.is_inference_rng_tracker = is_inference_rng_tracker
        self.reset()

    def is_initialized(self) -> bool:
        """True once a state was added or set."""
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = _DEFAULT_STATE_NAME

    def get_states(self) -> dict[str, torch.Tensor]:
        """A new dict of the current states. States are replaced, never changed in place, so the
        returned values stay valid snapshots (checkpoints store them)."""
        return dict(self.states_)

    def set_states(self, states: dict) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        original = _get_state()
        if _use_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = _get_state()
        _set_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added; call model_parallel_cuda_manual_seed first")
        outer_name, outer_state = self._current_state_name, _get_state()
        if outer_name != _DEFAULT_STATE_NAME:
            self.states_[outer_name] = outer_state
        _set_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            if outer_name != _DEFAULT_STATE_NAME:
                outer_state = self.states_[outer_name]
            _set_state(outer_state)
            self._current_state_name = outer_name


_CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker(
    use_te_rng_tracker: bool = False, inference_rng_tracker: bool = False, use_cudagraphable_rng: bool = False
) -> CudaRNGStatesTracker:
    """The process-wide tracker (Transformer Engine's and CUDA-graph-safe trackers are not supported)."""
    if use_te_rng_tracker or use_cudagraphable_rng:
        raise NotImplementedError(
            "Transformer Engine / CUDA-graph RNG trackers are not supported by megatron_lite"
        )
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(
    seed: int,
    te_rng_tracker: bool = False,
    inference_rng_tracker: bool = False,
    use_cudagraphable_rng: bool = False,
    tp_rank: int | None = None,
    ep_rank: int | None = None,
    etp_rank: int | None = None,
    gtp_remat_rank: int | None = None,
    egtp_remat_rank: int | None = None,
    force_reset_rng: bool = False,
    gtp_remat_world_size: int | None = None,
    egtp_remat_world_size: int | None = None,
) -> None:
    """Seed the streams as Megatron does: the default stream and ``data-parallel-rng`` with ``seed``
    (alike on all TP ranks), ``model-parallel-rng`` with ``seed + 2718 + tp_rank`` (different per TP
    rank) and ``expert-parallel-rng`` with ``seed + 1024 + 100 ep_rank + etp_rank``. Ranks left None
    come from parallel_state (0 before it is initialised)."""
    global _CUDA_RNG_STATE_TRACKER
    if te_rng_tracker or use_cudagraphable_rng:
        raise NotImplementedError(
            "Transformer Engine / CUDA-graph RNG trackers are not supported by megatron_lite"
        )
    initialised = parallel_state.is_initialized()
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank() if initialised else 0
    if ep_rank is None:
        ep_rank = parallel_state.get_expert_model_parallel_rank() if initialised else 0
    if etp_rank is None:
        etp_rank = parallel_state.get_expert_tensor_parallel_rank() if initialised else 0
    if force_reset_rng:
        _CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker(is_inference_rng_tracker=inference_rng_tracker)
    tracker = _CUDA_RNG_STATE_TRACKER
    tracker.reset()
    if _use_cuda():
        torch.cuda.manual_seed(seed)
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


# Activation checkpointing ------------------------------------------------------------------------

_IS_CHECKPOINTING = False


def is_checkpointing() -> bool:
    """True while a checkpointed function runs (forward without graph, or its recompute)."""
    return _IS_CHECKPOINTING


@contextlib.contextmanager
def _checkpointing():
    global _IS_CHECKPOINTING
    _IS_CHECKPOINTING = True
    try:
        yield
    finally:
        _IS_CHECKPOINTING = False


def _get_all_rng_states():
    cuda = torch.cuda.get_rng_state() if _use_cuda() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _set_all_rng_states(cpu_state, cuda_state, tracker_states) -> None:
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    get_cuda_rng_tracker().set_states(tracker_states)


class CheckpointFunction(torch.autograd.Function):
    """Run ``run_function`` without keeping its activations; recompute them in backward with every
    RNG stream (CPU, CUDA, tracker) as it was in forward, so dropout masks repeat exactly.

    With ``distribute_saved_activations`` the first input is kept only as this rank's 1/TP share
    between forward and backward (gathered back for the recompute): collective over the
    tensor-parallel group in backward.
    """

    @staticmethod
    def forward(ctx, run_function, distribute_saved_activations, *args):
        ctx.run_function = run_function
        ctx.distribute_saved_activations = distribute_saved_activations
        ctx.rng_states = _get_all_rng_states()
        with _checkpointing(), torch.no_grad():
            outputs = run_function(*args)
        if distribute_saved_activations:
            ctx.input_0_shape = args[0].data.shape
            # The caller's tensor itself: under saved-tensor hooks (the activation tracker) what
            # save_for_backward hands back is another tensor object, and restoring that one would leave
            # the caller's (say a received pipeline input, whose gradient is accumulated) flat.
            ctx.input_0 = args[0]
            args[0].data = split_tensor_into_1d_equal_chunks(args[0].data, new_buffer=True)
        ctx.save_for_backward(*args)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpointing is not compatible with .grad(); use .backward()")
        inputs = ctx.saved_tensors
        if ctx.distribute_saved_activations:
            ctx.input_0.data = gather_split_1d_tensor(inputs[0].data).view(ctx.input_0_shape)
            inputs = (ctx.input_0, *inputs[1:])
            del ctx.input_0
        outer_states = _get_all_rng_states()
        _set_all_rng_states(*ctx.rng_states)
        try:
            detached = detach_variable(inputs)
            with _checkpointing(), torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            _set_all_rng_states(*outer_states)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(x.grad if isinstance(x, torch.Tensor) else x for x in detached)
        return (None, None, *grads)


def checkpoint(function, distribute_saved_activations: bool, *args):
    """``function(*args)`` with its activations recomputed in backward (see CheckpointFunction)."""
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
