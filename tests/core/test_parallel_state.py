"""Process-group layouts and getters equal megatron-core's, in real gloo worlds."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist
from dist_helpers import run_world

from megatron_lite.core import parallel_state as ps
from megatron_lite.core.process_groups_config import ProcessGroupCollection

POWERS = [1, 2, 4, 8]


def layouts(world: int):
    for tp, pp, cp in itertools.product(POWERS, repeat=3):
        if world % (tp * pp * cp) == 0:
            yield tp, pp, cp


TOKENS = {
    "tp": "tp",
    "pp": "pp",
    "dp": "dp",
    "cp": "cp",
    "mp": "tp-pp",
    "dp_cp": "dp-cp",
    "tp_dp": "tp-dp",
    "tp_cp": "tp-cp",
    "tp_dp_cp": "tp-dp-cp",
}


def _megatron_core():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state as oracle
    return oracle


def oracle_layouts(world: int) -> list[dict]:
    """megatron-core's groups for every layout of ``world``, computed once in the test process (importing
    megatron-core in every worker would cost seconds each)."""
    oracle = _megatron_core()
    out = []
    for tp, pp, cp in layouts(world):
        dp = world // (tp * pp * cp)
        gen = oracle.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        groups = {name: gen.get_ranks(token) for name, token in TOKENS.items()}
        groups["embd"] = [oracle.default_embedding_ranks(r) for r in groups["pp"]]
        out.append({"tp": tp, "pp": pp, "cp": cp, "dp": dp, "groups": groups})
    return out


def _mine(groups, rank):
    return next(r for r in groups if rank in r)


def check_all_layouts(rank: int, world: int, cases: list[dict]) -> int:
    checked = 0
    for case in cases:
        tp, pp, cp, dp = case["tp"], case["pp"], case["cp"], case["dp"]
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
        )
        expected = {name: _mine(groups, rank) for name, groups in case["groups"].items() if name != "embd"}
        getters = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "cp": ps.get_context_parallel_group(),
            "mp": ps.get_model_parallel_group(),
            "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
        }
        for name, group in getters.items():
            assert dist.get_process_group_ranks(group) == expected[name], (tp, pp, cp, name)
        for name in ("tp_dp", "tp_cp", "tp_dp_cp"):
            assert ps.get_process_group_ranks(name) == expected[name], (tp, pp, cp, name)
        pp_ranks = expected["pp"]
        embd = case["groups"]["embd"][case["groups"]["pp"].index(pp_ranks)]
        if rank in embd:
            assert dist.get_process_group_ranks(ps.get_embedding_group()) == embd
        assert ps.is_rank_in_embedding_group() == (rank in embd)
        pp_rank = pp_ranks.index(rank)
        assert ps.get_tensor_model_parallel_world_size() == tp
        assert ps.get_pipeline_model_parallel_world_size() == pp
        assert ps.get_context_parallel_world_size() == cp
        assert ps.get_data_parallel_world_size() == dp
        assert ps.get_data_parallel_world_size(with_context_parallel=True) == dp * cp
        assert ps.get_tensor_model_parallel_rank() == expected["tp"].index(rank)
        assert ps.get_pipeline_model_parallel_rank() == pp_rank
        assert ps.get_data_parallel_rank() == expected["dp"].index(rank)
        assert ps.get_context_parallel_rank() == expected["cp"].index(rank)
        assert ps.is_pipeline_first_stage() == (pp_rank == 0)
        assert ps.is_pipeline_last_stage() == (pp_rank == pp - 1)
        assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[-1]
        assert ps.get_pipeline_model_parallel_next_rank() == pp_ranks[(pp_rank + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == pp_ranks[(pp_rank - 1) % pp]
        assert ps.get_tensor_model_parallel_src_rank() == expected["tp"][0]
        assert ps.get_data_parallel_src_rank() == expected["dp"][0]
        pgc = ProcessGroupCollection.use_mpu_process_groups()
        assert dist.get_process_group_ranks(pgc.pp) == pp_ranks
        assert dist.get_process_group_ranks(pgc.mp) == expected["mp"]
        assert (pgc.embd is not None) == (rank in embd)
        ps.destroy_model_parallel()
        assert not ps.model_parallel_is_initialized()
        checked += 1
    return checked


@pytest.mark.world
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_groups_match_megatron_core(world):
    cases = oracle_layouts(world)
    counts = run_world(check_all_layouts, world, cases)
    assert counts == [len(cases)] * world
    assert counts[0] >= 1


def test_rank_generator_matches_megatron_core_for_other_orders():
    """Pure enumeration, no world needed: every token for several orders and uneven dp."""
    from megatron_lite.core.parallel_state import RankGenerator

    checked = 0
    for tp, pp, cp, dp in itertools.product([1, 2, 4], [1, 2, 4], [1, 2], [1, 2, 3]):
        for order in ["tp-cp-ep-dp-pp", "tp-pp-cp-dp", "tp-dp-cp-pp", "cp-tp-pp-dp"]:
            oracle = _megatron_core().RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            mine = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
            for token in ["tp", "pp", "dp", "cp", "tp-pp", "dp-cp", "tp-dp-cp", "tp-dp", "tp-cp"]:
                assert mine.get_ranks(token) == oracle.get_ranks(token), (tp, pp, cp, dp, order, token)
                checked += 1
    assert checked == 3 * 3 * 2 * 3 * 4 * 9


def _bad_world_size(rank, world):
    with pytest.raises(RuntimeError, match="not divisible"):
        ps.initialize_model_parallel(tensor_model_parallel_size=4)
    with pytest.raises(RuntimeError, match="expert_tensor_model_pipeline_parallel size"):
        ps.initialize_model_parallel(expert_model_parallel_size=4)
    assert not ps.model_parallel_is_initialized()
    return True


@pytest.mark.world
def test_invalid_layouts_are_refused():
    assert run_world(_bad_world_size, 2) == [True, True]


EXPERT_TOKENS = {"ep": "ep", "expt_tp": "tp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp"}
EXPERT_LAYOUTS = [  # (tp, pp, cp, ep, etp) over 8 ranks
    (1, 1, 1, 2, None),
    (2, 1, 1, 2, None),
    (2, 1, 1, 2, 1),
    (1, 2, 1, 2, None),
    (2, 2, 1, 2, 1),
    (1, 1, 2, 4, None),
    (4, 1, 1, 2, 2),
    (1, 1, 1, 8, None),
]


def _expert_groups(rank: int, world: int, cases: list[dict]) -> int:
    for case in cases:
        tp, pp, cp, ep, etp = case["layout"]
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
        expected = {name: _mine(groups, rank) for name, groups in case["groups"].items()}
        getters = {
            "ep": ps.get_expert_model_parallel_group(),
            "expt_tp": ps.get_expert_tensor_parallel_group(),
            "tp_ep": ps.get_expert_tensor_and_model_parallel_group(),
            "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group(),
            "expt_dp": ps.get_expert_data_parallel_group(),
        }
        for name, group in getters.items():
            assert dist.get_process_group_ranks(group) == expected[name], (case["layout"], name)
        assert ps.get_expert_model_parallel_world_size() == ep
        assert ps.get_expert_model_parallel_rank() == expected["ep"].index(rank)
        assert ps.get_expert_tensor_parallel_world_size() == (etp or tp)
        assert ps.get_expert_tensor_parallel_rank() == expected["expt_tp"].index(rank)
        assert ps.get_expert_data_parallel_world_size() == world // ((etp or tp) * ep * pp)
        assert ps.get_expert_data_parallel_rank() == expected["expt_dp"].index(rank)
        assert ps.get_tensor_model_parallel_world_size() == tp  # the dense groups are unchanged
        ps.destroy_model_parallel()
    return len(cases)


@pytest.mark.world
def test_expert_parallel_groups_match_megatron_core():
    """megatron-core's expert grid: expert TP x EP x expert DP x PP, context parallelism folded into
    expert data parallelism, its pipelines the dense ones."""
    oracle, cases = _megatron_core(), []
    for tp, pp, cp, ep, etp in EXPERT_LAYOUTS:
        gen = oracle.RankGenerator(
            tp=etp or tp, ep=ep, dp=8 // ((etp or tp) * ep * pp), pp=pp, cp=1, order="tp-cp-ep-dp-pp"
        )
        groups = {name: gen.get_ranks(token) for name, token in EXPERT_TOKENS.items()}
        cases.append({"layout": (tp, pp, cp, ep, etp), "groups": groups})
    assert run_world(_expert_groups, 8, cases) == [len(cases)] * 8
