"""parallel_state's upstream surface: setters, assertion types before initialisation, the full
initialize_model_parallel signature, expert groups at ep == 1, and destroy resetting everything."""

from __future__ import annotations

import warnings

import pytest
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.core import parallel_state as ps
from megatron_lite.core.process_groups_config import ProcessGroupCollection


@pytest.fixture(autouse=True)
def _clean_state():
    ps.destroy_model_parallel()
    yield
    ps.destroy_model_parallel()


def test_getters_assert_before_initialisation():
    assert not ps.is_initialized() and not ps.model_parallel_is_initialized()
    for getter in (
        ps.get_tensor_model_parallel_group,
        ps.get_pipeline_model_parallel_group,
        ps.get_model_parallel_group,
        ps.get_tensor_model_parallel_world_size,
        ps.get_tensor_model_parallel_rank,
        ps.get_pipeline_model_parallel_rank,
        ps.get_pipeline_model_parallel_first_rank,
        ps.get_tensor_model_parallel_src_rank,
    ):
        with pytest.raises(AssertionError):
            getter()
    # check_initialized=False reads None instead of asserting, as upstream.
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    # Upstream's module globals read as None.
    assert ps._MODEL_PARALLEL_GROUP is None and ps._PIPELINE_GLOBAL_RANKS is None
    # Outside torch.distributed these report 0 rather than asserting.
    assert ps.get_data_parallel_world_size() == 0 and ps.get_data_parallel_rank() == 0
    assert ps.get_context_parallel_world_size() == 0
    with pytest.raises(AssertionError):
        ps.initialize_model_parallel()  # torch.distributed is not initialised


def test_setters_override_and_destroy_resets_them():
    ps.set_tensor_model_parallel_world_size(4)
    ps.set_tensor_model_parallel_rank(3)
    ps.set_pipeline_model_parallel_world_size(2)
    ps.set_pipeline_model_parallel_rank(1)
    ps.set_virtual_pipeline_model_parallel_world_size(2)
    ps.set_virtual_pipeline_model_parallel_rank(1)
    assert ps.get_tensor_model_parallel_world_size() == 4 and ps.get_tensor_model_parallel_rank() == 3
    assert ps.get_pipeline_model_parallel_world_size() == 2 and ps.get_pipeline_model_parallel_rank() == 1
    assert ps.is_pipeline_last_stage() and not ps.is_pipeline_first_stage()
    # With virtual stages only the last chunk of the last stage is "last".
    assert ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=1)
    assert not ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=0)
    with pytest.raises(AssertionError, match="vp_stage"):
        ps.is_pipeline_last_stage(ignore_virtual=False)
    assert ps.get_virtual_pipeline_model_parallel_rank() == 1

    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_rank() is None
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    with pytest.raises(AssertionError):
        ps.get_tensor_model_parallel_world_size()  # the override is gone too


def _expert_oracle(world: int, tp: int, pp: int, cp: int, order: str) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.parallel_state import RankGenerator

    gen = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    return {name: gen.get_ranks(token) for name, token in ps._EXPERT_GROUP_TOKENS.items()}


def _in_world(rank: int, world: int, oracle: dict) -> bool:
    ranks_of = dist.get_process_group_ranks
    ps.initialize_model_parallel(2, 1, order="tp-cp-ep-dp-pp", distributed_timeout_minutes=5)
    with pytest.raises(AssertionError, match="already initialized"):
        ps.initialize_model_parallel(2, 1)

    # Setters override the group's value; None restores it.
    true_tp_rank = ps.get_tensor_model_parallel_rank()
    ps.set_tensor_model_parallel_rank(7)
    assert ps.get_tensor_model_parallel_rank() == 7
    ps.set_tensor_model_parallel_rank(None)
    assert ps.get_tensor_model_parallel_rank() == true_tp_rank == rank % 2

    # Upstream's globals are the groups the getters return.
    assert ps._TENSOR_MODEL_PARALLEL_GROUP is ps.get_tensor_model_parallel_group()
    assert ps._PIPELINE_GLOBAL_RANKS == ranks_of(ps.get_pipeline_model_parallel_group())

    # Expert groups at ep == 1, laid out as megatron-core's expert rank generator lays them.
    for name, getter in [
        ("ep", ps.get_expert_model_parallel_group),
        ("expt_tp", ps.get_expert_tensor_parallel_group),
        ("tp_ep", ps.get_expert_tensor_and_model_parallel_group),
        ("tp_ep_pp", ps.get_expert_tensor_model_pipeline_parallel_group),
        ("expt_dp", ps.get_expert_data_parallel_group),
    ]:
        mine = next(r for r in oracle[name] if rank in r)
        assert ranks_of(getter()) == mine, name
    assert ps.get_expert_model_parallel_world_size() == 1 and ps.get_expert_model_parallel_rank() == 0
    assert ps.get_expert_tensor_parallel_world_size() == 2

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    assert pgc.dp_cp_ag is None and pgc.expt_dp_ag is None  # built by the caller, never by us
    assert ranks_of(pgc.expt_tp) == ranks_of(pgc.tp)

    ps.destroy_model_parallel()
    assert ps._MODEL_PARALLEL_GROUP is None and not ps.model_parallel_is_initialized()

    # Options for features megatron_lite lacks: accepted at their defaults, refused otherwise.
    for bad in (
        {"use_sharp": True},
        {"gtp_remat_size": 2},
        {"high_priority_stream_groups": ["tp"]},
    ):
        with pytest.raises(NotImplementedError, match=next(iter(bad))):
            ps.initialize_model_parallel(**bad)
    with pytest.raises(RuntimeError, match="interleaved"):
        ps.initialize_model_parallel(virtual_pipeline_model_parallel_size=2)

    # Virtual pipeline sizes are recorded (the schedules refuse interleaving themselves).
    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    assert ps.get_virtual_pipeline_model_parallel_world_size() == 2
    assert ps.get_virtual_pipeline_model_parallel_rank() == 0
    first_stage = ps.get_pipeline_model_parallel_rank() == 0
    # The embedding lives on the first chunk of the first stage and the last chunk of the last one.
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=0) == first_stage
    assert ps.is_rank_in_embedding_group(ignore_virtual=False, vp_stage=1) == (not first_stage)
    assert ps.is_rank_in_position_embedding_group() == first_stage
    ps.destroy_model_parallel()
    assert ps.get_virtual_pipeline_model_parallel_world_size() is None
    return True


@pytest.mark.world
def test_upstream_surface_in_a_world():
    oracle = _expert_oracle(2, 2, 1, 1, "tp-cp-ep-dp-pp")
    assert run_world(_in_world, 2, oracle) == [True] * 2
