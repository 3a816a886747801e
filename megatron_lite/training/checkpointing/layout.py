"""Where a checkpoint's files live and what layout they were written for: upstream's names
(``iter_0000010/mp_rank_XX[_YYY][_ZZZ]/model_optim_rng.pt``: tensor rank, pipeline rank with pipeline
parallelism, expert-parallel rank with expert parallelism; ``latest_checkpointed_iteration.txt``) and the
``metadata.json`` that records the parallel layout."""

from __future__ import annotations

import json
import os

from megatron_lite.core import parallel_state
from megatron_lite.core.dist_checkpointing.serialization import (
    CheckpointingException,
    load_metadata,
    read_object_bytes,
)
from megatron_lite.training.checkpointing import megatron_lm
from megatron_lite.training.checkpointing.distrib_optim import get_distributed_optimizer_checkpoint_name
from megatron_lite.training.checkpointing.megatron_lm_out import unchained
from megatron_lite.training.checkpointing.megatron_lm_pickles import SavedBytes
from megatron_lite.training.checkpointing.safety import CheckpointError, load_checkpoint_file

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
COMMON = "common.pt"  # a torch_dist checkpoint's plain state, beside DCP's files
CHECKPOINT_VERSION = 3.0


def shard_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1) -> str:
    """Upstream's ``get_checkpoint_name``: ``_{ep:03d}`` is appended with expert parallelism."""
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def get_checkpoint_name(
    root: str, iteration: int, tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0, ep_size: int = 1
) -> str:
    return os.path.join(
        root,
        f"iter_{iteration:07d}",
        shard_name(tp_rank, pp_rank, pp_size, ep_rank, ep_size),
        "model_optim_rng.pt",
    )


def my_checkpoint_name(root: str, iteration: int) -> str:
    """This rank's ``model_optim_rng.pt`` in iteration ``iteration`` of ``root``."""
    return os.path.join(root, f"iter_{iteration:07d}", my_shard_name(), "model_optim_rng.pt")


def model_keys(chunks: int) -> list[str]:
    """Upstream's payload keys: ``model`` for one chunk, ``model0``, ``model1``, ... for virtual stages."""
    return ["model"] if chunks == 1 else [f"model{i}" for i in range(chunks)]


def model_chunks(model) -> list:
    return model if isinstance(model, list) else [model]


def my_shard_name() -> str:
    return shard_name(
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_expert_model_parallel_rank(),
        parallel_state.get_expert_model_parallel_world_size(),
    )


def expert_layout() -> dict[str, int]:
    """The expert-parallel sizes, recorded only where they differ from a dense run's (ep 1, expert TP
    the dense TP): a dense checkpoint's record stays as it was."""
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    if ep == 1 and etp == parallel_state.get_tensor_model_parallel_world_size():
        return {}
    return {"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}


def parallel_layout() -> dict[str, int]:
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
        "data_parallel_size": parallel_state.get_data_parallel_world_size(),
        **expert_layout(),
    }


def _expert_sizes(layout: dict) -> tuple:
    tp = layout.get("tensor_model_parallel_size")
    return layout.get("expert_model_parallel_size", 1), layout.get("expert_tensor_parallel_size", tp)


def read_tracker(root: str, flag: str = "--load") -> int | None:
    """The latest iteration in ``root``; None when there is nothing to resume from."""
    tracker = os.path.join(root, TRACKER)
    if not os.path.isdir(root) or not os.listdir(root):
        return None
    if not os.path.exists(tracker):
        if any(name.startswith("iter_") for name in os.listdir(root)):
            raise CheckpointError(
                f"{flag} {root}: has checkpoint directories but no {TRACKER}; "
                f"point {flag} at a complete checkpoint directory"
            )
        return None
    try:
        with open(tracker) as f:
            text = f.read().strip()
        iteration = int(text)
    except (OSError, ValueError, UnicodeDecodeError):
        raise CheckpointError(f"{flag} {root}: {TRACKER} is unreadable or not an iteration number") from None
    if iteration < 0:
        raise CheckpointError(f"{flag} {root}: {TRACKER} holds a negative iteration ({iteration})")
    return iteration


def layout_error(root: str, saved: dict, current: dict) -> str:
    dense = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    if all(saved.get(k) == current[k] for k in dense) and expert_layout_differs(saved, current):
        (ep, etp), (ep_now, etp_now) = _expert_sizes(saved), _expert_sizes(current)
        return (
            f"--load {root}: saved with expert-parallel size {ep}, expert tensor-parallel size {etp} but this "
            f"run uses {ep_now}, {etp_now}; a --ckpt-format torch checkpoint loads at its saved expert layout "
            "only (save with --ckpt-format torch_dist to change it)"
        )
    return (
        f"--load {root}: saved with tp={saved.get('tensor_model_parallel_size')}, "
        f"pp={saved.get('pipeline_model_parallel_size')} but this run uses "
        f"tp={current['tensor_model_parallel_size']}, pp={current['pipeline_model_parallel_size']}; "
        "resume with the saved layout (--finetune or --pretrained-checkpoint load the weights at any layout)"
    )


def layout_differs(saved: dict, current: dict) -> bool:
    return expert_layout_differs(saved, current) or any(
        saved.get(k) != current[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size")
    )


def expert_layout_differs(saved: dict, current: dict) -> bool:
    """Whether the expert-parallel or expert tensor-parallel size changed: the legacy format's files hold
    each expert-parallel rank's experts by local index, which ``reshard`` does not remap. A layout that
    records no expert sizes has ep 1 and the expert TP of its own TP."""
    recorded = "expert_model_parallel_size" in saved or "expert_model_parallel_size" in current
    return recorded and _expert_sizes(saved) != _expert_sizes(current)


def read_shard(path: str, root: str, flag: str = "--load", mmap: bool = False) -> dict:
    """A ``model_optim_rng.pt``, never running code from it; one written by Megatron-LM comes back
    with what our loader reads (megatron_lm.as_megatron_lite)."""
    payload = load_checkpoint_file(path, root, mmap=mmap)
    return (
        megatron_lm.as_megatron_lite(payload, f"{flag} {root}", legacy=True)
        if megatron_lm.is_megatron_lm(payload)
        else payload
    )


def _megatron_lm_layout(root: str, iteration: int, flag: str) -> dict | None:
    """The layout of a Megatron-LM ``torch``-format iteration (no metadata.json: its rank-0 shard's
    ``args`` say it); None when the directory holds no such shard."""
    directory = os.path.join(root, f"iter_{iteration:07d}")
    for name in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"):  # Megatron-LM's own probe order
        path = os.path.join(directory, name, "model_optim_rng.pt")
        if os.path.exists(path):
            payload = read_shard(path, root, flag, mmap=True)
            return payload.get("parallel_layout") if payload.get("megatron_lm") else None
    return None


def read_metadata(root: str, iteration: int, flag: str = "--load") -> dict:
    """``iter_*/metadata.json``: the saving run's parallel layout ({} when it holds no object); for
    Megatron-LM's ``torch`` format, which writes none, the layout its ``args`` record."""
    path = os.path.join(root, f"iter_{iteration:07d}", METADATA)
    try:
        with open(path) as f:
            saved = json.load(f)
    except FileNotFoundError:
        layout = _megatron_lm_layout(root, iteration, flag)
        if layout is not None:
            return layout
        raise CheckpointError(f"{flag} {root}: iteration {iteration} is incomplete (no {METADATA})") from None
    except (OSError, ValueError):
        raise CheckpointError(f"{flag} {root}: iteration {iteration} has an unreadable {METADATA}") from None
    return saved if isinstance(saved, dict) else {}


def is_distributed_checkpoint(root: str, iteration: int, flag: str = "--load") -> bool:
    """Whether iteration ``iteration`` of ``root`` is in ``torch_dist`` format (megatron-core's
    metadata.json says so), not the legacy one."""
    return read_metadata(root, iteration, flag).get("sharded_backend") == "torch_dist"


def read_common(root: str, iteration: int, flag: str = "--load") -> dict:
    """A ``torch_dist`` checkpoint's ``common.pt`` (iteration, config, layout, schedule, RNG, ...),
    read without running code from it; Megatron-LM's as megatron_lm.as_megatron_lite gives it."""
    path = os.path.join(root, f"iter_{iteration:07d}", COMMON)
    if os.path.exists(path):
        common = load_checkpoint_file(path, root, legacy=False)
    else:
        common = _common_state_object(root, iteration, flag)
    if megatron_lm.is_megatron_lm(common):
        common = megatron_lm.as_megatron_lite(common, f"{flag} {root}", legacy=False)
    elif isinstance(common, dict) and isinstance(common.get("optimizer"), dict):
        common["optimizer"] = unchained(common["optimizer"])  # a MoE model's, saved as Megatron-LM's
    if not isinstance(common, dict) or not isinstance(common.get("config"), dict):
        raise CheckpointError(f"{flag} {root}: iteration {iteration}: {COMMON} is not a megatron_lite one")
    return common


# Where megatron-core keeps the common state since 2026 (Megatron-LM's HEAD): one ShardedObject in the
# DCP checkpoint, instead of common.pt.
COMMON_STATE_OBJECT = "common_state/shard_0_1"


def _common_state_object(root: str, iteration: int, flag: str):
    directory = os.path.join(root, f"iter_{iteration:07d}")
    try:
        metadata = load_metadata(directory)
    except FileNotFoundError:  # no .metadata: not a checkpoint yet
        raise CheckpointError(f"{flag} {root}: iteration {iteration} is incomplete (no {COMMON})") from None
    except CheckpointError:
        raise
    except Exception as err:  # a refused or damaged .metadata
        raise CheckpointError(
            f"{flag} {root}: iteration {iteration}: cannot read its .metadata "
            f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})"
        ) from None
    try:
        data = read_object_bytes(directory, metadata, COMMON_STATE_OBJECT)
    except (OSError, CheckpointingException) as err:
        raise CheckpointError(
            f"{flag} {root}: iteration {iteration}: cannot read its common state: {err}"
        ) from None
    if data is None:
        raise CheckpointError(f"{flag} {root}: iteration {iteration} is incomplete (no {COMMON})")
    # megatron-core's planner stores ``torch.save([common])`` as it is; DCP's own pickles the io.BytesIO
    # holding it (rebuilt as its bytes): Megatron-LM reads both.
    name = os.path.join(directory, COMMON_STATE_OBJECT)
    saved = load_checkpoint_file(name, root, legacy=False, data=data)
    if isinstance(saved, SavedBytes):
        saved = load_checkpoint_file(name, root, legacy=False, data=saved.value)
    if not isinstance(saved, list) or len(saved) != 1:
        raise CheckpointError(
            f"{flag} {root}: iteration {iteration}: its common state is not megatron-core's"
        )
    return saved[0]


def check_layout(root: str, iteration: int) -> None:
    """Refuse a checkpoint of another (tp, pp) layout before looking for this rank's shard."""
    saved = read_metadata(root, iteration)
    if layout_differs(saved, parallel_layout()):
        raise CheckpointError(layout_error(root, saved, parallel_layout()))


def my_optimizer_shard(root: str, iteration: int) -> str:
    return get_distributed_optimizer_checkpoint_name(my_checkpoint_name(root, iteration))
