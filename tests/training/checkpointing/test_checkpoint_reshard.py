"""Weights-only loads at another layout, and ``--use-checkpoint-args``.

A checkpoint saved at tp 2 x pp 2 loads with ``--finetune`` at any tp, pp, vp and data-parallel size:
the first iteration's loss is the one of a finetune at the saved layout (the reference: the same
weights, the same data), to float rounding. A full resume at another layout is still refused.
"""

from __future__ import annotations

import pytest
from dist_helpers import ok, parse_losses, run_pretrain

from megatron_lite.training.arguments import parse_args

pytestmark = pytest.mark.world  # every test here starts processes

ARCHITECTURE = "--num-layers 8 --hidden-size 64 --num-attention-heads 4 --max-position-embeddings 32".split()
ARCHITECTURE += ["--vocab-size", "256"]
LLAMA = [*ARCHITECTURE, "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope"]
LLAMA += ["--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights"]
TRAINING = "--seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4".split()
TRAINING += "--lr-warmup-iters 2 --log-interval 1 --num-workers 0".split()
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
# Each layout's flags, and how the reshard line names it.
LAYOUTS = {
    "tp1_pp4": (["--pipeline-model-parallel-size", "4"], "tp=1 pp=4"),
    "tp2_pp1_dp2": (["--tensor-model-parallel-size", "2", "--nproc-per-node", "4"], "tp=2 pp=1"),
    "tp1_pp2_vp2": (
        ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"],
        "tp=1 pp=2 vp=2",
    ),
    "tp1_pp1": ([], "tp=1 pp=1"),
}


def first_loss(result) -> float:
    return parse_losses(ok(result).stdout)[1]


def finetune(root, architecture, layout, *extra):
    return run_pretrain([*architecture, *TRAINING, *layout, "--train-iters", "1", *extra], root)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A Llama-shaped model trained 3 iterations at tp 2 x pp 2 and saved; the first loss of a finetune
    from it at the saved layout."""
    root = tmp_path_factory.mktemp("reshard")
    ok(run_pretrain([*LLAMA, *TRAINING, *TP2_PP2, "--train-iters", "3", "--save", "c"], root))
    reference = finetune(root, LLAMA, TP2_PP2, "--finetune", "--load", "c")
    assert "resharding" not in reference.stdout  # the saved layout: today's path, no reshard
    return root, first_loss(reference)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_finetune_at_another_layout_starts_at_the_saved_layouts_loss(llama, layout):
    root, reference = llama
    flags, described = LAYOUTS[layout]
    result = finetune(root, LLAMA, flags, "--finetune", "--load", "c")
    assert f"resharding checkpoint weights from tp=2 pp=2 to {described}\n" in result.stdout
    assert first_loss(result) == pytest.approx(reference, rel=5e-4)


def test_tied_output_layer_is_taken_from_the_word_embedding(tmp_path):
    """Saved on one stage, tied weights have no output layer: the last stage's copy is the embedding."""
    ok(run_pretrain([*ARCHITECTURE, *TRAINING, "--train-iters", "2", "--save", "c"], tmp_path))
    reference = first_loss(finetune(tmp_path, ARCHITECTURE, [], "--finetune", "--load", "c"))
    resharded = finetune(tmp_path, ARCHITECTURE, TP2_PP2, "--finetune", "--load", "c")
    assert "from tp=1 pp=1 to tp=2 pp=2" in resharded.stdout
    assert first_loss(resharded) == pytest.approx(reference, rel=5e-4)


def test_full_resume_at_another_layout_is_refused_in_one_line(llama):
    root, _ = llama
    result = finetune(root, LLAMA, ["--tensor-model-parallel-size", "2"], "--load", "c")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "saved with tp=2, pp=2 but this run uses tp=2, pp=1" in lines[0], result.stderr
    assert "--finetune or --pretrained-checkpoint load the weights at any layout" in lines[0]


def test_use_checkpoint_args_takes_the_saved_architecture(llama):
    root, reference = llama
    layout = ["--pipeline-model-parallel-size", "2"]
    args = ["--use-checkpoint-args", "--pretrained-checkpoint"]
    result = run_pretrain([*TRAINING, *layout, "--train-iters", "1", *args, "c"], root)
    assert first_loss(result) == pytest.approx(reference, rel=5e-4)
    # With a tokenizer the vocabulary stays the checkpoint's (validation checks it holds the tokenizer's).
    cfg = parse_args([*TRAINING, *args, str(root / "c"), "--tokenizer-type", "NullTokenizer"])
    m = cfg.model
    assert (m.num_layers, m.num_query_groups, m.normalization, m.gated_linear_unit) == (8, 2, "RMSNorm", True)
    assert m.activation_func.__name__ == "silu" and not m.share_embeddings_and_output_weights
    assert (m.vocab_size, m.ffn_hidden_size, m.tensor_model_parallel_size) == (256, 128, 1)


def test_use_checkpoint_args_without_a_checkpoint_is_one_line(tmp_path):
    result = run_pretrain([*TRAINING, "--use-checkpoint-args", "--load", "missing"], tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert (
        result.stderr.count("\n") == 1
        and "--use-checkpoint-args: --load missing holds no checkpoint" in result.stderr
    )
