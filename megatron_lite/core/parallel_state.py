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
DEFAULT_ORDER = "tp-cp-ep-dp-pp"  # Megatron core's: tensor-parallel ranks adjacent, pipeline stages farthest


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
    """This rank's groups and their global ranks, keyed by short group names (``tp``, ``dp_cp``, ...)."""

    groups: dict[str, object] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)

    def group(self, name: str, check_initialized: bool = True):
        if check_initialized and name not in self.groups:
            raise AssertionError(f"{_DESCRIPTIONS.get(name, name)} group is not initialized")
        return self.groups.get(name)

    def global_ranks(self, name: str) -> list[int]:
        if name not in self.ranks:
            raise AssertionError(f"{_DESCRIPTIONS.get(name, name)} group is not initialized")
        return self.ranks[name]


_STATE: _ParallelState | None = None

# Values forced by the upstream ``set_*`` helpers; None means "read it from the group". Kept apart
# from the groups because upstream lets tests set them with or without initialised groups.
_OVERRIDES: dict[str, int | None] = {}
_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK: int | None = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE: int | None = None
# What higher layers keep per group and must let go with the groups (the pipeline package's
# shared-memory channels): registered by them, so this module imports nothing above it.
_DESTROY_HOOKS: list = []

_DESCRIPTIONS = {
    "tp": "tensor model parallel",
    "pp": "pipeline model parallel",
    "mp": "model parallel",
    "dp": "data parallel",
    "dp_cp": "data parallel (with context parallel)",
    "cp": "context parallel",
    "tp_dp": "tensor and data parallel",
    "tp_dp_cp": "tensor and data parallel (with context parallel)",
    "tp_cp": "tensor and context parallel",
    "embd": "embedding",
    "pos_embd": "position embedding",
    "ep": "expert model parallel",
    "expt_tp": "expert tensor parallel",
    "tp_ep": "expert tensor and model parallel",
    "tp_ep_pp": "expert tensor-model-pipeline parallel",
    "expt_dp": "expert data parallel",
}

# Tokens of the groups built from the decoder rank generator, in upstream's creation order.
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

# ... and from the expert rank generator.
_EXPERT_GROUP_TOKENS = {
    "ep": "ep",
    "expt_tp": "tp",
    "tp_ep": "tp-ep",
    "tp_ep_pp": "tp-ep-pp",
    "expt_dp": "dp",
}

# Upstream's module globals, readable by name (``parallel_state._MODEL_PARALLEL_GROUP``), mapped to
# (group name, "group" or "ranks").
_UPSTREAM_GLOBALS = {
    "_TENSOR_MODEL_PARALLEL_GROUP": ("tp", "group"),
    "_PIPELINE_MODEL_PARALLEL_GROUP": ("pp", "group"),
    "_MODEL_PARALLEL_GROUP": ("mp", "group"),
    "_EMBEDDING_GROUP": ("embd", "group"),
    "_POSITION_EMBEDDING_GROUP": ("pos_embd", "group"),
    "_DATA_PARALLEL_GROUP": ("dp", "group"),
    "_DATA_PARALLEL_GROUP_WITH_CP": ("dp_cp", "group"),
    "_CONTEXT_PARALLEL_GROUP": ("cp", "group"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP": ("tp_dp", "group"),
    "_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP": ("tp_dp_cp", "group"),
    "_TENSOR_AND_CONTEXT_PARALLEL_GROUP": ("tp_cp", "group"),
    "_EXPERT_MODEL_PARALLEL_GROUP": ("ep", "group"),
    "_EXPERT_TENSOR_PARALLEL_GROUP": ("expt_tp", "group"),
    "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("tp_ep", "group"),
    "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("tp_ep_pp", "group"),
    "_EXPERT_DATA_PARALLEL_GROUP": ("expt_dp", "group"),
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS": ("tp", "ranks"),
    "_PIPELINE_GLOBAL_RANKS": ("pp", "ranks"),
    "_MODEL_PARALLEL_GLOBAL_RANKS": ("mp", "ranks"),
    "_DATA_PARALLEL_GLOBAL_RANKS": ("dp", "ranks"),
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP": ("dp_cp", "ranks"),
    "_CONTEXT_PARALLEL_GLOBAL_RANKS": ("cp", "ranks"),
    "_EMBEDDING_GLOBAL_RANKS": ("embd", "ranks"),
    "_POSITION_EMBEDDING_GLOBAL_RANKS": ("pos_embd", "ranks"),
    "_EXPERT_MODEL_PARALLEL_RANKS": ("ep", "ranks"),
}


def __getattr__(name: str):
    # PEP 562: upstream code and tests read the module globals directly; serve them from the state.
    if name in _UPSTREAM_GLOBALS:
        key, kind = _UPSTREAM_GLOBALS[name]
        if _STATE is None:
            return None
        return (_STATE.groups if kind == "group" else _STATE.ranks).get(key)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    expert_tensor_parallel_size: int | None = None,
    nccl_communicator_config_path: str | None = None,
    distributed_timeout_minutes: int = 30,
    order: str = DEFAULT_ORDER,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    create_gloo_process_groups: bool = True,
    high_priority_stream_groups: list[str] | None = None,
    sharp_enabled_group: str | None = None,
    rank_offset: int = 0,
    local_world_size: int | None = None,
) -> None:
    """Build every model-parallel group. Collective: call on all ranks of the world, same arguments.

    The signature is megatron.core's; the expert-parallel groups (``expert_model_parallel_size``,
    ``expert_tensor_parallel_size``) are built as upstream's, ahead of the MoE layers that will use
    them. Options for features megatron_lite lacks (hierarchical/hybrid CP, GTP remat, several
    distributed-optimizer instances, SHARP, NCCL configs, high-priority streams) are accepted at their
    defaults and refused with NotImplementedError otherwise.
    """
    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    assert dist.is_initialized(), "torch.distributed must be initialized before initialize_model_parallel"
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    unsupported = {
        "hierarchical_context_parallel_sizes": bool(hierarchical_context_parallel_sizes),
        "hybrid_context_parallel": hybrid_context_parallel,
        "gtp_remat_size": gtp_remat_size != 1,
        "expert_gtp_remat_size": expert_gtp_remat_size != 1,
        "num_distributed_optimizer_instances": num_distributed_optimizer_instances != 1,
        "use_sharp": use_sharp,
        "sharp_enabled_group": sharp_enabled_group is not None,
        "nccl_communicator_config_path": nccl_communicator_config_path is not None,
        "high_priority_stream_groups": bool(high_priority_stream_groups),
    }
    for name, bad in unsupported.items():
        if bad:
            raise NotImplementedError(f"{name} is not supported yet by megatron_lite")

    world_size = local_world_size if local_world_size is not None else dist.get_world_size()
    if world_size % (tp * pp * cp) != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by tensor_model_parallel_size ({tp}) "
            f"x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})"
        )
    if virtual_pipeline_model_parallel_size is not None and pp <= 1:
        raise RuntimeError("pipeline-model-parallel size should be greater than 1 with interleaved schedule")
    # Checked after the layout (as upstream): a bad layout reports itself even over live groups.
    assert _STATE is None, "model parallel groups are already initialized; call destroy_model_parallel first"
    dp = world_size // (tp * pp * cp)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=rank_offset)
    # The expert grid (upstream's): expert TP x EP x expert DP x PP over the same ranks, context
    # parallelism folded into expert data parallelism. With ep == 1 and the dense TP its groups mostly
    # coincide with dense ones (sharing their communicators).
    etp, ep = expert_tensor_parallel_size or tp, expert_model_parallel_size
    if world_size % (etp * ep * pp) != 0:
        raise RuntimeError(
            f"world_size ({world_size}) is not divisible by expert_tensor_model_pipeline_parallel size "
            f"({etp * ep * pp})"
        )
    expert_dp = world_size // (etp * ep * pp)
    assert order.endswith("pp") or pp == 1 or expert_dp == dp, (
        "When not using pp-last rank ordering, the data parallel size of the attention and moe layers must be the same"
    )
    expert = RankGenerator(tp=etp, ep=ep, dp=expert_dp, pp=pp, cp=1, order=order, rank_offset=rank_offset)
    assert generator.get_ranks("pp") == expert.get_ranks("pp"), (
        "Pipeline parallel groups are expected to be the same for Non-Expert and Expert part, but got "
        f"{generator.get_ranks('pp')} and {expert.get_ranks('pp')}"
    )
    embedding_ranks_of = get_embedding_ranks or default_embedding_ranks
    position_ranks_of = get_position_embedding_ranks or default_position_embedding_ranks
    timeout = timedelta(minutes=distributed_timeout_minutes)
    rank = dist.get_rank()
    state = _ParallelState()

    created: dict[tuple, object] = {}

    def add(name: str, ranks: list[int], backend: str | None = None) -> None:
        # new_group is itself collective over the whole world: every rank creates every group, in the
        # same order. Groups with identical ranks (dp and dp-cp when cp == 1, say) share one communicator.
        key = (tuple(ranks), backend)
        if key not in created:
            created[key] = dist.new_group(ranks, timeout=timeout, backend=backend)
        if rank in ranks:
            state.groups[name], state.ranks[name] = created[key], ranks

    for name, token in _GROUP_TOKENS.items():
        for ranks in generator.get_ranks(token):
            add(name, ranks, pipeline_model_parallel_comm_backend if name == "pp" else None)
            if name == "pp":
                add("embd", embedding_ranks_of(ranks))
                add("pos_embd", position_ranks_of(ranks))
    for name, token in _EXPERT_GROUP_TOKENS.items():
        for ranks in expert.get_ranks(token):
            add(name, ranks)
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _STATE = state


def is_initialized() -> bool:
    """True once the groups exist (upstream: code paths usable with or without model parallelism)."""
    return _STATE is not None


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget all groups, forced sizes/ranks and virtual-pipeline state (the process groups themselves
    are destroyed with the default group)."""
    global _STATE, _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _STATE = None
    _OVERRIDES.clear()
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
    for hook in _DESTROY_HOOKS:
        hook()


def register_destroy_hook(hook) -> None:
    """Call ``hook()`` in every later destroy_model_parallel (once per hook, however often registered):
    for state a higher layer keeps per group, such as the pipeline's shared-memory channels."""
    if hook not in _DESTROY_HOOKS:
        _DESTROY_HOOKS.append(hook)


def _state() -> _ParallelState:
    if _STATE is None:
        raise AssertionError("model parallel groups are not initialized; call initialize_model_parallel")
    return _STATE


def _group(name: str, check_initialized: bool = True):
    if _STATE is None:
        if check_initialized:
            raise AssertionError(f"{_DESCRIPTIONS[name]} group is not initialized")
        return None
    return _STATE.group(name, check_initialized)


def _rank_in(name: str) -> int:
    return _state().global_ranks(name).index(dist.get_rank())


def _dist_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _size_or_rank(key: str, name: str, want_rank: bool, zero_without_dist: bool = False) -> int:
    """A forced value (``set_*``), else this rank's size/rank in group ``name``. Upstream returns 0
    for some getters when torch.distributed is not initialised."""
    if _OVERRIDES.get(key) is not None:
        return _OVERRIDES[key]
    if zero_without_dist and not _dist_ready():
        return 0
    return _rank_in(name) if want_rank else len(_state().global_ranks(name))


# Groups ----------------------------------------------------------------------------------------


def get_tensor_model_parallel_group(check_initialized: bool = True):
    return _group("tp", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    return _group("pp", check_initialized)


def get_context_parallel_group(check_initialized: bool = True):
    return _group("cp", check_initialized)


def get_model_parallel_group(check_initialized: bool = True):
    return _group("mp", check_initialized)


def get_embedding_group(check_initialized: bool = True):
    return _group("embd", check_initialized)


def get_position_embedding_group(check_initialized: bool = True):
    return _group("pos_embd", check_initialized)


def get_data_parallel_group(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
):
    # One distributed-optimizer instance only, so the "partial" group is the whole data-parallel group.
    return _group("dp_cp" if with_context_parallel else "dp")


def get_data_parallel_group_gloo(with_context_parallel: bool = False, partial_data_parallel: bool = False):
    """The data-parallel group when it already runs on gloo (megatron_lite builds no gloo copies)."""
    group = get_data_parallel_group(with_context_parallel=with_context_parallel)
    assert str(dist.get_backend(group)).lower() == "gloo", "data parallel group-gloo is not initialized"
    return group


def get_tensor_and_data_parallel_group(check_initialized: bool = True, with_context_parallel: bool = False):
    return _group("tp_dp_cp" if with_context_parallel else "tp_dp", check_initialized)


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    return _group("tp_cp", check_initialized)


def get_expert_model_parallel_group(check_initialized: bool = True):
    return _group("ep", check_initialized)


def get_expert_tensor_parallel_group(check_initialized: bool = True):
    return _group("expt_tp", check_initialized)


def get_expert_tensor_and_model_parallel_group(check_initialized: bool = True):
    return _group("tp_ep", check_initialized)


def get_expert_tensor_model_pipeline_parallel_group(check_initialized: bool = True, with_egtp_remat=False):
    return _group("tp_ep_pp", check_initialized)


def get_expert_data_parallel_group(
    check_initialized: bool = True, with_gtp_remat: bool = True, partial_expert_data_parallel: bool = False
):
    return _group("expt_dp", check_initialized)


# Sizes and ranks (each honours the matching ``set_*`` override) ---------------------------------


def get_tensor_model_parallel_world_size() -> int:
    return _size_or_rank("tp_size", "tp", want_rank=False)


def get_tensor_model_parallel_rank() -> int:
    return _size_or_rank("tp_rank", "tp", want_rank=True)


def get_pipeline_model_parallel_world_size() -> int:
    return _size_or_rank("pp_size", "pp", want_rank=False)


def get_pipeline_model_parallel_rank() -> int:
    return _size_or_rank("pp_rank", "pp", want_rank=True)


def get_context_parallel_world_size() -> int:
    return _size_or_rank("", "cp", want_rank=False, zero_without_dist=True)


def get_context_parallel_rank() -> int:
    return _size_or_rank("", "cp", want_rank=True, zero_without_dist=True)


def get_context_parallel_global_ranks(check_initialized: bool = True) -> list[int] | None:
    if _STATE is None and not check_initialized:
        return None
    return list(_state().global_ranks("cp"))


def get_tensor_and_context_parallel_world_size() -> int:
    return _size_or_rank("", "tp_cp", want_rank=False, zero_without_dist=True)


def get_tensor_and_context_parallel_rank() -> int:
    return _size_or_rank("", "tp_cp", want_rank=True, zero_without_dist=True)


def get_data_parallel_world_size(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    name = "dp_cp" if with_context_parallel else "dp"
    return _size_or_rank("dp_size", name, want_rank=False, zero_without_dist=True)


def get_data_parallel_rank(
    with_context_parallel: bool = False, with_gtp_remat: bool = True, partial_data_parallel: bool = False
) -> int:
    name = "dp_cp" if with_context_parallel else "dp"
    return _size_or_rank("dp_rank", name, want_rank=True, zero_without_dist=True)


def get_expert_model_parallel_world_size() -> int:
    return _size_or_rank("ep_size", "ep", want_rank=False, zero_without_dist=True)


def get_expert_model_parallel_rank() -> int:
    return _size_or_rank("ep_rank", "ep", want_rank=True, zero_without_dist=True)


def get_expert_tensor_parallel_world_size() -> int:
    return _size_or_rank("etp_size", "expt_tp", want_rank=False, zero_without_dist=True)


def get_expert_tensor_parallel_rank() -> int:
    return _size_or_rank("etp_rank", "expt_tp", want_rank=True, zero_without_dist=True)


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return _size_or_rank("", "tp_ep", want_rank=False, zero_without_dist=True)


def get_expert_tensor_and_model_parallel_rank() -> int:
    return _size_or_rank("", "tp_ep", want_rank=True, zero_without_dist=True)


def get_expert_data_parallel_world_size(
    with_gtp_remat: bool = True, partial_expert_data_parallel=False
) -> int:
    return _size_or_rank("", "expt_dp", want_rank=False, zero_without_dist=True)


def get_expert_data_parallel_rank(with_gtp_remat: bool = True, partial_expert_data_parallel=False) -> int:
    return _size_or_rank("", "expt_dp", want_rank=True, zero_without_dist=True)


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


# Setters: force a value (tests, and code running a stage outside a real world); None restores
# the group's own value.


def set_tensor_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["tp_size"] = world_size


def set_tensor_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["tp_rank"] = rank


def set_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["pp_size"] = world_size


def set_pipeline_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["pp_rank"] = rank


def set_data_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["dp_rank"] = rank


def set_expert_model_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["ep_size"] = world_size


def set_expert_model_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["ep_rank"] = rank


def set_expert_tensor_parallel_world_size(world_size: int | None) -> None:
    _OVERRIDES["etp_size"] = world_size


def set_expert_tensor_parallel_rank(rank: int | None) -> None:
    _OVERRIDES["etp_rank"] = rank


def set_virtual_pipeline_model_parallel_world_size(world_size: int | None) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_virtual_pipeline_model_parallel_rank(rank: int | None) -> None:
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


# Stage facts -----------------------------------------------------------------------------------


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    if not ignore_virtual and get_virtual_pipeline_model_parallel_world_size() is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if vp_stage != 0:
            return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    vp_size = get_virtual_pipeline_model_parallel_world_size()
    if not ignore_virtual and vp_size is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
        if vp_stage != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    ranks = _STATE.ranks.get("embd") if _STATE is not None else None
    rank = dist.get_rank()
    if not ranks or rank not in ranks:
        return False
    if ignore_virtual:
        return True
    # With virtual stages only the first (last) chunk of the first (last) stage holds the embedding.
    if rank == ranks[0]:
        return is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if rank == ranks[-1]:
        return is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    return True


def is_rank_in_position_embedding_group() -> bool:
    ranks = _STATE.ranks.get("pos_embd") if _STATE is not None else None
    return ranks is not None and dist.get_rank() in ranks


def get_pipeline_model_parallel_first_rank() -> int:
    return _state().global_ranks("pp")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state().global_ranks("pp")[get_pipeline_model_parallel_world_size() - 1]


def get_pipeline_model_parallel_next_rank() -> int:
    ranks = _state().global_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()]


def get_pipeline_model_parallel_prev_rank() -> int:
    ranks = _state().global_ranks("pp")
    return ranks[(get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()]


def get_tensor_model_parallel_src_rank() -> int:
    return _state().global_ranks("tp")[0]


def get_model_parallel_src_rank() -> int:
    return _state().global_ranks("mp")[0]


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _state().global_ranks("dp_cp" if with_context_parallel else "dp")[0]


def get_expert_model_parallel_src_rank() -> int:
    return _state().global_ranks("ep")[0]


def get_process_group_ranks(name: str) -> list[int]:
    """Global ranks of this rank's group ``name`` (``tp``, ``pp``, ``dp``, ``embd``, ...)."""
    return list(_state().global_ranks(name))


def default_backend(local_world_size: int = 1) -> str:
    """nccl when every local rank can own a GPU, gloo otherwise (CPU, laptops, CI)."""
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size else "gloo"
