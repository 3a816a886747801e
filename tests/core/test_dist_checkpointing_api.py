"""megatron-core's ``dist_checkpointing.save`` / ``load`` of nested state dicts, over megatron_lite's own
planners: sharded values through DCP, the rest through ``common.pt`` (read weights-only), the strict
handling of keys, and the asynchronous callers. A gloo world of one process, in this process."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from megatron_lite.core.dist_checkpointing import (
    CheckpointingException,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    load,
    load_content_metadata,
    load_tensors_metadata,
    save,
)
from megatron_lite.core.dist_checkpointing.dict_utils import diff
from megatron_lite.core.dist_checkpointing.strategies.async_utils import (
    AsyncCallsQueue,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from megatron_lite.core.dist_checkpointing.validation import StrictHandling


@pytest.fixture
def world(tmp_path_factory):
    store = dist.FileStore(
        str(tmp_path_factory.mktemp("store") / "store"), 1
    )  # not in the checkpoint's tmp_path
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _split_in_two(key: str, data: torch.Tensor) -> list[ShardedTensor]:
    """A factory's build: the tensor saved as two halves under two keys."""
    a, b = data.chunk(2)
    return [ShardedTensor.from_rank_offsets(f"{key}.a", a), ShardedTensor.from_rank_offsets(f"{key}.b", b)]


def _state(base: float = 0.0) -> dict:
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.arange(6.0).view(2, 3) + base),
        "opt": [ShardedObject("sched", {"step": 3 + base}, (1,), (0,))],
        "f": ShardedTensorFactory(
            "f",
            torch.arange(4.0) + base,
            lambda k, t, r, fr: _split_in_two(k, t),
            lambda parts: torch.cat(parts),
        ),
        "iteration": 7,
        "args": {"lr": 0.1},
    }


def test_save_then_load_gives_back_sharded_and_common_values(world, tmp_path):
    save(_state(), tmp_path, content_metadata={"format": 1})
    assert {p.name for p in tmp_path.iterdir()} >= {".metadata", "__0_0.distcp", "common.pt", "metadata.json"}

    loaded = load(_state(base=100.0), tmp_path)  # the request's own values are overwritten

    expected = {"w": torch.arange(6.0).view(2, 3), "opt": [{"step": 3.0}], "f": torch.arange(4.0)}
    assert diff(expected, {k: loaded[k] for k in expected}) == ([], [], [])
    assert loaded["iteration"] == 7 and loaded["args"] == {"lr": 0.1}
    assert load_content_metadata(preloaded_state_dict=loaded) == {"format": 1}


def test_a_load_reads_any_part_of_a_saved_tensor(world, tmp_path):
    save({"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0))}, tmp_path)
    second_half = ShardedTensor("w", torch.zeros(4), torch.float32, (4,), (8,), (4,), (2,))

    # The access check would refuse a request that reads half of "w" only.
    loaded = load({"x": second_half}, tmp_path, validate_access_integrity=False)

    assert torch.equal(loaded["x"], torch.arange(4.0, 8.0))


def test_tensors_metadata_names_every_saved_tensor_whole(world, tmp_path):
    save(_state(), tmp_path)

    saved = load_tensors_metadata(tmp_path)

    assert sorted(saved) == ["f.a", "f.b", "w"]
    assert saved["w"].global_shape == (2, 3) and saved["w"].dtype == torch.float32


def test_return_all_reports_missing_and_unexpected_keys(world, tmp_path):
    save(
        {
            "a": ShardedTensor.from_rank_offsets("a", torch.ones(2)),
            "b": ShardedTensor.from_rank_offsets("b", torch.ones(2)),
        },
        tmp_path,
    )
    request = {
        "a": ShardedTensor.from_rank_offsets("a", torch.zeros(2)),
        "c": ShardedTensor.from_rank_offsets("c", torch.zeros(2)),
    }

    loaded, missing, unexpected = load(request, tmp_path, strict=StrictHandling.RETURN_ALL)

    assert (missing, unexpected) == ({"b"}, {"c"})
    assert torch.equal(loaded["a"], torch.ones(2)) and "c" not in loaded


def test_raise_unexpected_names_the_key_before_reading(world, tmp_path):
    save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2))}, tmp_path)

    with pytest.raises(CheckpointingException, match="Unexpected keys.*'c'"):
        load({"c": ShardedTensor.from_rank_offsets("c", torch.zeros(2))}, tmp_path, strict="raise_unexpected")


def test_common_values_are_read_weights_only(world, tmp_path):
    save({"when": datetime.date(2024, 1, 1)}, tmp_path)  # torch.save pickles it; a weights-only load refuses

    with pytest.raises(CheckpointingException, match="common.pt"):
        load({}, tmp_path)


def test_load_of_a_directory_that_is_no_checkpoint_says_so(world, tmp_path):
    with pytest.raises(CheckpointingException, match="is not a distributed checkpoint"):
        load({}, tmp_path)
    with pytest.raises(CheckpointingException, match="does not exist"):
        load({}, tmp_path / "nowhere")


def test_async_callers_close_without_a_process_group():
    assert not dist.is_initialized()
    PersistentAsyncCaller().close()
    PersistentAsyncCaller().__del__()
    TemporalAsyncCaller().close(abort=True)


@pytest.mark.world
@pytest.mark.parametrize("persistent", [True, False])
def test_async_save_writes_what_a_sync_save_writes(world, tmp_path, persistent):
    (tmp_path / "async").mkdir()
    (tmp_path / "sync").mkdir()
    calls = AsyncCallsQueue(persistent)

    calls.schedule_async_request(save(_state(), tmp_path / "async", async_sharded_save=True))
    save(_state(), tmp_path / "sync")
    assert calls.maybe_finalize_async_calls(blocking=True) == [0]
    calls.close()

    assert not any("write_results" in p.name for p in (tmp_path / "async").iterdir())
    assert diff(load(_state(1.0), tmp_path / "async"), load(_state(2.0), tmp_path / "sync")) == ([], [], [])


@pytest.mark.world
@pytest.mark.parametrize("persistent", [True, False])
def test_an_async_save_writes_the_values_it_was_given_not_later_ones(world, tmp_path, persistent):
    """Training goes on while the write runs: the checkpoint holds the tensors as they were when the
    save was called."""
    calls = AsyncCallsQueue(persistent)
    state = _state()
    calls.schedule_async_request(save(state, tmp_path, async_sharded_save=True))
    state["w"].data.add_(1000.0)  # the next optimizer step, in place
    assert calls.maybe_finalize_async_calls(blocking=True) == [0]
    calls.close()
    assert torch.equal(load(_state(5.0), tmp_path)["w"], torch.arange(6.0).view(2, 3))
