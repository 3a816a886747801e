"""Model-parallel process groups, laid out exactly as Megatron core lays them out.

Every rank of the world is a point in a grid whose axes are named by an order string such as
``"tp-cp-ep-dp-pp"``; the leftmost axis varies fastest, so tensor-parallel ranks are contiguous and
pipeline stages are outermost. A group for a token such as ``"tp-pp"`` is the set of ranks that differ
only along those axes. All groups are built once by :func:`initialize_model_parallel` and kept in one
state object; the upstream getters below are thin reads of it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

_AXES = ("tp", "pp", "dp", "ep", "cp")


class RankGenerator:
    """Enumerates the rank groups of each parallelism token for a given layout and order."""

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0):
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        names = order.lower().split("-")
        for name in names:
            if name not in sizes:
                raise RuntimeError(f"unknown parallelism '{name}' in order '{order}'")
        if len(set(names)) != len(names):
            raise RuntimeError(f"order '{order}' names a parallelism twice")
        for name in _AXES:
            if name not in names:
                if sizes[name] != 1:
                    raise RuntimeError(f"order '{order}' must name '{name}' since its size is {sizes[name]}")
                names.append(name)
        self.order = "-".join(names)
        self.names = names
        self.sizes = [sizes[n] for n in names]
        self.world_size = tp * pp * dp * ep * cp
        self.rank_offset = rank_offset

    def get_ranks(self, token: str) -> list[list[int]]:
        """Groups for ``token`` (e.g. ``"tp-dp"``), ordered as Megatron core orders them."""
        wanted = set(token.split("-"))
        strides = [1]
        for size in self.sizes[:-1]:
            strides.append(strides[-1] * size)
        inner = [(s, d) for n, s, d in zip(self.names, self.sizes, strides) if n in wanted]
        outer = [(s, d) for n, s, d in zip(self.names, self.sizes, strides) if n not in wanted]

        def offsets(axes):
            # Leftmost axis fastest: itertools.product varies its last argument fastest, so reverse.
            for coords in itertools.product(*(range(s) for s, _ in reversed(axes))):
                yield sum(c * d for c, (_, d) in zip(coords, reversed(axes)))

        return [[self.rank_offset + base + off for off in offsets(inner)] for base in offsets(outer)]


def default_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Stages holding the word embeddings: first and last stage (one stage when pp == 1)."""
    return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]


def default_position_embedding_ranks(pp_ranks: list[int]) -> list[int]:
    """Stages holding the position embeddings: the first stage."""
    return [pp_ranks[0]]


@dataclass
class _ParallelState:
    """This rank's groups and their global ranks, keyed by upstream's group names."""

    groups: dict[str, object] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    virtual_pp_size: int | None = None

    def group(self, name: str):
        if name not in self.groups:
            raise AssertionError(f"{name} group is not initialized")
        return self.groups[name]

    def global_ranks(self, name: str) -> list[int]:
        if name not in self.ranks:
            raise AssertionError(f"{name} group is not initialized")
        return self.ranks[name]


_STATE: _ParallelState | None = None

# Tokens of the groups built from the decoder rank generator, under the names the getters use.
_GROUP_TOKENS = {
    "dp_cp": "dp-cp",
    "dp": "dp",
    "cp": "cp",
    "mp": "tp-pp",
    "tp": "tp",
    "pp": "pp",
    "tp_dp_cp": "tp-dp-cp",
    "tp_dp": "tp-dp",
    "tp_cp": "tp-cp",
}


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    hierarchical_context_parallel_sizes: list[int] | None = None,
    hybrid_context_parallel: bool = False,
    expert_model_parallel_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
) -> None:
    """Build every model-parallel group. Collective: call on all ranks of the world, same arguments.

    Arguments mirror megatron.core.parallel_state; expert, hierarchical-CP, SHARP and NCCL-config
    options are accepted for signature compatibility but only their defaults are supported.
    """
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before initialize_model_parallel")
    if _STATE is not None:
        raise RuntimeError("model parallel groups are already initialized; call destroy_model_parallel first")
    unsupported = {
        "expert_model_parallel_size": expert_model_parallel_size != 1,
        "expert_tensor_parallel_size": expert_tensor_parallel_size not in (None, 1),
        "hierarchical_context_parallel_sizes": bool(hierarchical_context_parallel_sizes),
        "hybrid_context_parallel": hybrid_context_parallel,
        "num_distributed_optimizer_instances": num_distributed_optimizer_instances != 1,
    }
    for name, bad in unsupported.items():
        if bad:
            raise NotImplementedError(f"{name} is not supported yet by megatron_lite")

    world_size = dist.get_world_size()
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if world_size % (tp * pp * cp) != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) "
            f"x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})"
        )
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise RuntimeError("virtual pipeline parallelism needs pipeline_model_parallel_size > 1")
    dp = world_size // (tp * pp * cp)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    embedding_ranks_of = get_embedding_ranks or default_embedding_ranks
    position_ranks_of = get_position_embedding_ranks or default_position_embedding_ranks
    timeout = timedelta(minutes=distributed_timeout_minutes)
    rank = dist.get_rank()
    state = _ParallelState(virtual_pp_size=virtual_pipeline_model_parallel_size)

    created: dict[tuple, object] = {}

    def add(name: str, ranks: list[int], backend: str | None = None) -> None:
        # new_group is itself collective over the whole world: every rank creates every group, in the
        # same order. Groups with identical ranks (dp and dp-cp when cp == 1, say) share one communicator.
        key = (tuple(ranks), backend)
        if key not in created:
            created[key] = dist.new_group(ranks, timeout=timeout, backend=backend)
        group = created[key]
        if rank in ranks:
            state.groups[name], state.ranks[name] = group, ranks

    for name, token in _GROUP_TOKENS.items():
        for ranks in generator.get_ranks(token):
            add(name, ranks, pipeline_model_parallel_comm_backend if name == "pp" else None)
            if name == "pp":
                add("embd", embedding_ranks_of(ranks))
                add("pos_embd", position_ranks_of(ranks))
    _STATE = state


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget all groups (the process groups themselves are destroyed with the default group)."""
    global _STATE
    _STATE = None


def _state() -> _ParallelState:
    if _STATE is None:
        raise AssertionError("model parallel groups are not initialized; call initialize_model_parallel")
    return _STATE


def _rank_in(name: str) -> int:
    return _state().global_ranks(name).index(dist.get_rank())


# Groups ----------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _state().group("tp")


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _state().group("pp")


def get_context_parallel_group(check_initialized: bool = True):
    return _state().group("cp")


def get_model_parallel_group(check_initialized: bool = True):
    return _state().group("mp")


def get_embedding_group(check_initialized: bool = True):
    return _state().group("embd")


def get_position_embedding_group(check_initialized: bool = True):
    return _state().group("pos_embd")


def get_data_parallel_group(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    return _state().group("dp_cp" if with_context_parallel else "dp")


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False):
    return _state().group("tp_dp_cp" if with_context_parallel else "tp_dp")


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _state().group("tp_cp")


# Sizes and ranks -------------------------------------------------------------------------------


def get_tensor_model_parallel_world_size() -> int:
    return len(_state().global_ranks("tp"))


def get_tensor_model_parallel_rank() -> int:
    return _rank_in("tp")


def get_pipeline_model_parallel_world_size() -> int:
    return len(_state().global_ranks("pp"))


def get_pipeline_model_parallel_rank() -> int:
    return _rank_in("pp")


def get_context_parallel_world_size() -> int:
    return len(_state().global_ranks("cp"))


def get_context_parallel_rank() -> int:
    return _rank_in("cp")


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int]:
    return list(_state().global_ranks("cp"))


def get_data_parallel_world_size(
    with_context_parallel: bool = False, partial_data_parallel: bool = False
) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return len(_state().global_ranks("dp_cp" if with_context_parallel else "dp"))


def get_data_parallel_rank(with_context_parallel: bool = False, partial_data_parallel: bool = False) -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return _rank_in("dp_cp" if with_context_parallel else "dp")


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _state().virtual_pp_size


# Stage facts -----------------------------------------------------------------------------------


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    if not ignore_virtual and _state().virtual_pp_size is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    vp_size = _state().virtual_pp_size
    if not ignore_virtual and vp_size is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if vp_stage != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    return dist.get_rank() in _state().ranks.get("embd", [])


def get_pipeline_model_parallel_first_rank() -> int:
    return _state().global_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state().global_ranks("pp")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state().global_ranks("pp")
    return ranks[(_rank_in("pp") + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state().global_ranks("pp")
    return ranks[(_rank_in("pp") - 1) % len(ranks)]


def get_tensor_model_parallel_src_rank() -> int:
    return _state().global_ranks("tp")[0]


def get_model_parallel_src_rank() -> int:
    return _state().global_ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _state().global_ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_process_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group ``name`` (``tp``, ``pp``, ``dp``, ``embd``, ...)."""
    return list(_state().global_ranks(name))


def default_backend(local_world_size: int = 1) -> str:
    """nccl when every local rank can own a GPU, gloo otherwise (CPU, laptops, CI)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "gloo"
