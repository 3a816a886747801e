"""Uneven pipeline splits (--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-
pipeline-split): megatron-core's layer assignment, loss parity with one process, and a checkpoint of
one split refused by a run of another."""

from __future__ import annotations

import itertools

import pytest
import torch
from dist_helpers import SMALL_MODEL, parse_losses, run_pretrain

from megatron_lite.core.transformer.pipeline_layer_split import pipeline_layer_counts
from megatron_lite.core.transformer.transformer_block import get_num_layers_to_build
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.transformer.transformer_layer import get_transformer_layer_offset

# (num_layers, pp, vp, first, last, account for embedding, account for loss)
SPLITS = [
    (8, 4, None, 3, 1, False, False),
    (8, 4, None, None, 2, False, False),
    (8, 4, None, 5, None, False, False),
    (7, 2, None, 3, None, False, False),
    (6, 2, None, 4, 2, False, False),
    (12, 4, 2, 2, 2, False, False),
    (14, 4, 2, None, 2, False, False),
    (14, 4, None, None, None, True, True),
    (7, 4, None, None, None, True, False),
    (7, 4, None, None, None, False, True),
    (6, 4, 2, None, None, True, True),
    (10, 2, 3, None, None, True, True),
    (8, 2, 2, None, None, False, False),
]


def _kwargs(num_layers, pp, vp, first, last, embedding, loss) -> dict:
    return dict(
        num_layers=num_layers,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss,
    )


@pytest.mark.parametrize("split", SPLITS, ids=[str(s) for s in SPLITS])
def test_layer_counts_and_offsets_are_megatron_cores(split):
    from megatron.core.transformer import TransformerConfig as UpstreamConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build as up_count
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset as up_offset

    kwargs = _kwargs(*split)
    ours = TransformerConfig(hidden_size=64, num_attention_heads=4, **kwargs)
    theirs = UpstreamConfig(hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32, **kwargs)
    pp, vp = split[1], split[2]
    for pp_rank, vp_stage in itertools.product(range(pp), [None] if vp is None else range(vp)):
        where = dict(vp_stage=vp_stage, pp_rank=pp_rank)
        assert get_num_layers_to_build(ours, **where) == up_count(theirs, **where), where
        assert get_transformer_layer_offset(ours, **where) == up_offset(theirs, **where), where
    # Every layer is built exactly once.
    counts = pipeline_layer_counts(ours)
    assert sum(map(sum, counts)) == split[0]


LAYOUTS = [
    ("Ett|tt|tt|tL", 4),
    ("Ettt|(tt|)*2,L", 4),
    ("E|t*3|tt|t|t|t|t|tL", 4),
    ("Et|tt|t|ttL", 2),
    ("E|(t|)*6,L", 4),
    ("Et*2,t|(t)*3|tt|L", 2),
]


@pytest.mark.parametrize("text,pp", LAYOUTS)
def test_layout_is_parsed_and_split_as_megatron_core_does(text, pp, mocker):
    from megatron.core import parallel_state as up_state
    from megatron.core.transformer import TransformerConfig as UpstreamConfig
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout as Theirs
    from megatron.core.transformer.transformer_block import get_num_layers_to_build as up_count
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset as up_offset

    from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    ours_parsed = PipelineParallelLayerLayout.parse_str_to_list(text)
    assert [[x.name for x in stage] for stage in ours_parsed] == [
        [x.name for x in stage] for stage in Theirs.parse_str_to_list(text)
    ]
    layers = [x.name for stage in ours_parsed for x in stage].count("decoder")
    ours = TransformerConfig(
        num_layers=layers, pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=text
    )
    theirs = UpstreamConfig(
        num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_dtype=torch.float32,
        pipeline_model_parallel_size=pp, pipeline_model_parallel_layout=text,
    )  # fmt: skip
    assert ours.virtual_pipeline_model_parallel_size == theirs.virtual_pipeline_model_parallel_size
    vp = theirs.virtual_pipeline_model_parallel_size
    # Upstream's layout path reads the rank and the virtual size from its parallel_state.
    mocker.patch.object(up_state, "get_virtual_pipeline_model_parallel_world_size", return_value=vp)
    rank = mocker.patch.object(up_state, "get_pipeline_model_parallel_rank")
    for pp_rank, vp_stage in itertools.product(range(pp), [None] if vp is None else range(vp)):
        rank.return_value = pp_rank
        where = dict(vp_stage=vp_stage, pp_rank=pp_rank)
        assert get_num_layers_to_build(ours, **where) == up_count(theirs, **where), where
        assert get_transformer_layer_offset(ours, **where) == up_offset(theirs, **where), where


ITERS = 6
SIX_LAYERS = [*SMALL_MODEL, "--num-layers", "6", "--seed", "1234", "--train-iters", str(ITERS)]


def _losses(tmp_path, args) -> dict[int, float]:
    result = run_pretrain([*SIX_LAYERS, *args], tmp_path)
    assert result.returncode == 0, result.stderr
    return parse_losses(result.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("one"), [])


@pytest.mark.world
@pytest.mark.parametrize(
    "split",
    [
        # 3, 1, 1, 1 layers: the first stage also holds the embedding.
        "--decoder-first-pipeline-num-layers 3 --decoder-last-pipeline-num-layers 1",
        # Chunks of 0, 1, 1, 1 and 1, 1, 1, 0 layers: the embedding's and the loss's chunks hold no layer.
        "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split "
        "--virtual-pipeline-model-parallel-size 2",
        # Chunks of 1, 2 and 1, 2 layers on two ranks, spelled out.
        "--pipeline-model-parallel-layout Et|tt|t|ttL",
    ],
)
def test_uneven_split_loss_matches_single_process(tmp_path, reference, split):
    pp = "2" if "layout" in split else "4"
    losses = _losses(tmp_path, [*split.split(), "--pipeline-model-parallel-size", pp])
    assert sorted(losses) == list(range(1, ITERS + 1))
    for it in range(1, ITERS + 1):
        assert losses[it] == pytest.approx(reference[it], rel=5e-4), (it, losses, reference)


@pytest.mark.world
def test_checkpoint_of_another_split_is_refused(tmp_path):
    pp2 = ["--pipeline-model-parallel-size", "2", "--train-iters", "2"]
    saved = run_pretrain(
        [*SIX_LAYERS, *pp2, "--decoder-first-pipeline-num-layers", "4", "--save", "c"], tmp_path
    )
    assert saved.returncode == 0, saved.stderr
    loaded = run_pretrain([*SIX_LAYERS, *pp2, "--load", "c"], tmp_path)
    assert loaded.returncode != 0
    assert "[[4, 2]] layers" in loaded.stderr and "[[3, 3]]" in loaded.stderr, loaded.stderr
    assert "--decoder-first-pipeline-num-layers" in loaded.stderr
    assert "Traceback" not in loaded.stderr
