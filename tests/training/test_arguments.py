"""Megatron flag names map onto the typed config; bad input is refused before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from dist_helpers import PRETRAIN, REPO

from megatron_lite.training.arguments import parse_args
from megatron_lite.training.config import ConfigContainer

BAD_INPUT = [
    (["--num-layers", "6", "--pipeline-model-parallel-size", "4"], "--num-layers"),
    (["--num-attention-heads", "6", "--tensor-model-parallel-size", "4"], "--num-attention-heads"),
    (["--hidden-size", "100", "--num-attention-heads", "8"], "--hidden-size"),
    (["--global-batch-size", "10", "--micro-batch-size", "4"], "--global-batch-size"),
    (["--nproc-per-node", "6", "--pipeline-model-parallel-size", "4"], "--nproc-per-node"),
    (["--hidden-size", "0"], "--hidden-size"),
    (["--use-rope-scaling"], "--use-rope-scaling"),  # learned positions: nothing to scale
    (["--rope-scaling-factor", "32"], "--rope-scaling-factor"),  # without --use-rope-scaling
    (["--openai-gelu", "--swiglu"], "--openai-gelu"),
    (["--micro-batch-size", "-1"], "--micro-batch-size"),
    (["--train-iters", "0"], "--train-iters"),
    (["--lr", "-0.1"], "--lr"),
    (["--seq-length", "128", "--max-position-embeddings", "64"], "--seq-length"),
    (["--wandb-project", "proj"], "--wandb-exp-name"),
    (["--wandb-exp-name", "run"], "--wandb-project"),
    (["--mlflow-experiment", "exp"], "--mlflow-run-name"),
    (["--lr-decay-style", "exponential"], "--lr-decay-style"),
    (["--save-interval", "5"], "--save-interval"),
    (["--log-memory-per-pp-stage"], "--log-memory-per-pp-stage"),
    (["--fp16"], "--fp16"),
    (["--data-path", "/data/corpus"], "--data-path"),  # no /data/corpus.bin / .idx
    (["--num-workers", "-1"], "--num-workers"),
    (["--reset-attention-mask"], "--reset-attention-mask"),
    (["--overlap-param-gather"], "--overlap-param-gather"),
    (["--ddp-bucket-size", "0"], "--ddp-bucket-size"),
    (
        ["--context-parallel-size", "2", "--seq-length", "30", "--max-position-embeddings", "30"],
        "--seq-length",
    ),
    (["--hidden-dropout", "1.5"], "--hidden-dropout"),
    (["--train-samples", "160", "--train-iters", "5"], "--train-samples"),
    (["--lr-decay-samples", "100"], "--lr-decay-samples"),
    (["--save", "ck", "--ckpt-format", "zarr"], "--ckpt-format"),
    (["--save", "ck", "--async-save"], "--async-save"),  # torch_dist only, as upstream
    (["--group-query-attention", "--num-query-groups", "3"], "--num-query-groups"),
    (
        ["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
        "--num-query-groups",
    ),
    (["--num-query-groups", "2"], "--num-query-groups"),
    (["--group-query-attention"], "--group-query-attention"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent"),
    (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent"),
    (
        ["--position-embedding-type", "rope", "--kv-channels", "4", "--rotary-percent", "0.3"],
        "--rotary-percent",
    ),
    (["--position-embedding-type", "alibi"], "--position-embedding-type"),
    (["--position-embedding-type", "relative"], "--position-embedding-type"),
    (["--normalization", "BatchNorm"], "--normalization"),
    (["--swiglu", "--hidden-size", "16", "--num-attention-heads", "4"], "--ffn-hidden-size"),
    (["--swiglu", "--squared-relu"], "--squared-relu"),
    (["--norm-epsilon", "0"], "--norm-epsilon"),
    (["--recompute-method", "uniform", "--recompute-num-layers", "1"], "--recompute-method"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "1"], "--recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "block"], "--recompute-num-layers"),
    (
        "--recompute-granularity full --recompute-method block --recompute-num-layers 3 "
        "--num-layers 4 --pipeline-model-parallel-size 2".split(),
        "--recompute-num-layers",
    ),
    (["--recompute-granularity", "partial"], "--recompute-granularity"),
    (["--recompute-granularity", "selective", "--recompute-modules", "moe"], "--recompute-modules"),
    (["--recompute-modules", "mlp"], "--recompute-modules"),
    (["--sequence-parallel"], "--sequence-parallel"),
    (
        "--sequence-parallel --tensor-model-parallel-size 4 --context-parallel-size 2 --seq-length 20 "
        "--max-position-embeddings 20 --num-attention-heads 4 --hidden-size 64".split(),
        "--sequence-parallel",
    ),
    (["--distribute-saved-activations"], "--distribute-saved-activations"),
    (["--defer-embedding-wgrad-compute"], "--defer-embedding-wgrad-compute"),  # pp 1: no flush
    (
        "--defer-embedding-wgrad-compute --wgrad-deferral-limit -1 --pipeline-model-parallel-size 2".split(),
        "--wgrad-deferral-limit",
    ),
    (
        "--defer-embedding-wgrad-compute --overlap-grad-reduce --pipeline-model-parallel-size 2".split(),
        "--defer-embedding-wgrad-compute",
    ),
    (["--virtual-pipeline-model-parallel-size", "2"], "--virtual-pipeline-model-parallel-size"),
    (
        "--virtual-pipeline-model-parallel-size 3 --pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--virtual-pipeline-model-parallel-size",
    ),
    (
        "--num-layers-per-virtual-pipeline-stage 3 --pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--num-layers-per-virtual-pipeline-stage",
    ),
    (
        "--virtual-pipeline-model-parallel-size 2 --pipeline-model-parallel-size 4 --num-layers 8 "
        "--global-batch-size 4 --micro-batch-size 2".split(),
        "--global-batch-size",
    ),
    (
        "--num-virtual-stages-per-pipeline-rank 2 --virtual-pipeline-model-parallel-size 2 "
        "--pipeline-model-parallel-size 2".split(),
        "--num-virtual-stages-per-pipeline-rank",
    ),
    (
        "--decoder-first-pipeline-num-layers 3 --pipeline-model-parallel-size 4 --num-layers 8".split(),
        "--decoder-first-pipeline-num-layers",
    ),
    (
        "--decoder-last-pipeline-num-layers 9 --pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--decoder-last-pipeline-num-layers",
    ),
    (["--decoder-first-pipeline-num-layers", "2"], "--decoder-first-pipeline-num-layers"),  # pp 1
    (
        "--decoder-first-pipeline-num-layers 0 --pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--decoder-first-pipeline-num-layers",
    ),
    (
        "--decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 4 "
        "--pipeline-model-parallel-size 3 --num-layers 8".split(),
        "--decoder-first-pipeline-num-layers",
    ),
    (
        "--decoder-last-pipeline-num-layers 2 --account-for-loss-in-pipeline-split "
        "--pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--decoder-last-pipeline-num-layers",
    ),
    (
        "--account-for-embedding-in-pipeline-split --pipeline-model-parallel-size 2 --num-layers 8".split(),
        "--account-for-embedding-in-pipeline-split",
    ),
    (
        "--decoder-first-pipeline-num-layers 3 --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-model-parallel-size 2 --num-layers 6".split(),
        "--num-layers-per-virtual-pipeline-stage",
    ),
    (
        "--decoder-first-pipeline-num-layers 3 --num-virtual-stages-per-pipeline-rank 2 "
        "--pipeline-model-parallel-size 2 --num-layers 6 --global-batch-size 8 --micro-batch-size 2".split(),
        "--decoder-first-pipeline-num-layers",
    ),
    (["--pipeline-model-parallel-layout", "Et|tL"], "--pipeline-model-parallel-layout"),  # 2 of 8 layers
    (
        "--pipeline-model-parallel-layout Ettt|tttt|L --pipeline-model-parallel-size 3 "
        "--num-layers 7 --decoder-last-pipeline-num-layers 1".split(),
        "--pipeline-model-parallel-layout",
    ),
    (
        "--pipeline-model-parallel-layout Ettt|tttt|L --pipeline-model-parallel-size 2 --num-layers 7".split(),
        "--pipeline-model-parallel-layout",
    ),
    (
        "--num-virtual-stages-per-pipeline-rank 0 --pipeline-model-parallel-size 2".split(),
        "--num-virtual-stages-per-pipeline-rank",
    ),
    (
        "--virtual-pipeline-model-parallel-size 0 --pipeline-model-parallel-size 2".split(),
        "--virtual-pipeline-model-parallel-size",
    ),
]


@pytest.mark.parametrize("argv,flag", BAD_INPUT, ids=[b[1] + "-" + "_".join(b[0][1:2]) for b in BAD_INPUT])
def test_bad_input_is_one_line_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("pretrain.py: error: ") and flag in err
    if "not supported" not in err:
        assert "Traceback" not in err


def test_unknown_flag_gets_close_match_suggestion(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layer", "4"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean --num-layers?" in err


def test_malformed_value_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--num-layers", "four"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--num-layers" in err and "invalid int value" in err


def test_flags_map_onto_config_sections():
    cfg = parse_args(
        [
            "--num-layers",
            "4",
            "--hidden-size",
            "64",
            "--num-attention-heads",
            "4",
            "--seq-length",
            "32",
            "--max-position-embeddings",
            "32",
            "--micro-batch-size",
            "1",
            "--global-batch-size",
            "8",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
            "--nproc-per-node",
            "8",
            "--lr",
            "0.01",
            "--min-lr",
            "0.001",
            "--lr-decay-style",
            "cosine",
            "--lr-warmup-fraction",
            "0.1",
            "--clip-grad",
            "0.5",
            "--weight-decay",
            "0.1",
            "--adam-beta2",
            "0.95",
            "--bf16",
            "--seed",
            "7",
            "--tensorboard-dir",
            "tb",
            "--tensorboard-log-interval",
            "2",
            "--log-memory-to-tensorboard",
            "--wandb-project",
            "p",
            "--wandb-exp-name",
            "e",
            "--untie-embeddings-and-output-weights",
            "--save",
            "ck",
            "--save-interval",
            "3",
            "--load",
            "ck",
            "--no-load-optim",
            "--exit-interval",
            "9",
        ]
    )
    assert isinstance(cfg, ConfigContainer)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.ffn_hidden_size) == (4, 64, 256)
    assert cfg.dataset.sequence_length == cfg.model.seq_length == 32
    assert cfg.world_size == 8 and cfg.data_parallel_size == 2 and cfg.num_microbatches == 4
    assert cfg.optimizer.lr == 0.01 and cfg.optimizer.bf16 and cfg.model.bf16
    assert cfg.scheduler.lr_decay_style == "cosine" and cfg.scheduler.lr_warmup_fraction == 0.1
    assert cfg.rng.seed == cfg.dataset.random_seed == 7
    assert cfg.logger.tensorboard_dir == "tb" and cfg.logger.tensorboard_log_interval == 2
    assert cfg.logger.log_memory_to_tensorboard and cfg.logger.wandb_exp_name == "e"
    assert not cfg.model.share_embeddings_and_output_weights
    assert cfg.checkpoint.save == "ck" and cfg.checkpoint.load_optim is False
    assert cfg.train.exit_interval == 9


def test_llama_flags_map_onto_the_model_config():
    import torch.nn.functional as F

    cfg = parse_args(
        "--hidden-size 256 --num-attention-heads 8 --position-embedding-type rope --rotary-base 500000 "
        "--use-rope-scaling --rope-scaling-factor 32 --rotary-percent 0.5 --rotary-interleaved --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
        "--group-query-attention --num-query-groups 2 --disable-bias-linear --add-qkv-bias "
        "--untie-embeddings-and-output-weights --make-vocab-size-divisible-by 64 --vocab-size 1000".split()
    )
    m = cfg.model
    assert (m.position_embedding_type, m.rotary_base, m.rotary_percent) == ("rope", 500000, 0.5)
    assert m.rope_scaling and m.rope_scaling_factor == 32.0
    assert m.rotary_interleaved and m.normalization == "RMSNorm" and m.layernorm_epsilon == 1e-6
    assert m.gated_linear_unit and m.activation_func is F.silu
    assert m.ffn_hidden_size == 640  # upstream's SwiGLU default: int(4 h 2/3 / 64) 64
    assert m.num_query_groups == 2 and not m.add_bias_linear and m.add_qkv_bias
    assert not m.share_embeddings_and_output_weights and m.padded_vocab_size == 1024
    assert parse_args(["--layernorm-epsilon", "1e-6"]).model.layernorm_epsilon == 1e-6
    assert parse_args(["--num-attention-heads", "8"]).model.num_query_groups == 8  # one group per head
    # Checkpoints record the activation by name: GPT-2's tanh GELU must not read as "gelu".
    assert parse_args(["--openai-gelu"]).model.activation_func.__name__ == "openai_gelu"


def test_memory_flag_without_dir_gets_a_default_dir(tmp_path):
    cfg = parse_args(["--log-memory-to-tensorboard"])
    assert cfg.logger.tensorboard_dir and cfg.logger.tensorboard_dir.startswith("runs")
    assert not os.path.exists(os.path.join(tmp_path, "runs"))


def _pretrain(args, cwd):
    # A fresh interpreter, as a user starts it (run_pretrain forks a preloaded one).
    return subprocess.run(
        [sys.executable, PRETRAIN, *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.world
def test_bad_input_starts_nothing_and_writes_nothing(tmp_path):
    result = _pretrain(
        [
            "--num-layers",
            "6",
            "--pipeline-model-parallel-size",
            "4",
            "--tensorboard-dir",
            "tb",
            "--save",
            "ck",
            "--log-memory-to-tensorboard",
        ],
        tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "--num-layers" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.world
def test_help_lists_the_flags(tmp_path):
    result = _pretrain(["--help"], REPO)
    assert result.returncode == 0
    for flag in (
        "--pipeline-model-parallel-size",
        "--log-memory-to-tensorboard",
        "--tensorboard-dir",
        "--wandb-project",
        "--global-batch-size",
        "--nproc-per-node",
        "--save",
        "--load",
    ):
        assert flag in result.stdout


def test_adjusted_values_are_one_note_on_stdout_not_stderr(capsys):
    cfg = parse_args(["--train-iters", "2", "--lr-warmup-iters", "2"])
    out, err = capsys.readouterr()
    assert err == ""
    assert out.count("pretrain.py: note: ") == 1 and "capping lr_warmup_steps" in out
    assert cfg.scheduler.lr_warmup_steps == cfg.scheduler.lr_decay_steps - 1


@pytest.mark.parametrize("units", [False, True, None])
def test_bf16_on_a_cpu_without_bf16_units_is_one_note(units, capsys, mocker):
    mocker.patch("megatron_lite.training.config.validate.general.has_bf16_matrix_units", return_value=units)
    mocker.patch("torch.cuda.is_available", return_value=False)
    parse_args(["--bf16"])
    out, err = capsys.readouterr()
    assert err == ""
    noted = out.count("pretrain.py: note: --bf16 on a CPU without bf16 matrix instructions")
    assert noted == (1 if units is False else 0), out


def test_cpu_bf16_units_come_from_the_kernels_flags(mocker, tmp_path):
    from megatron_lite.utils import cpu_features

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    real_open = open
    mocker.patch(
        "builtins.open",
        side_effect=lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k),
    )
    assert cpu_features.has_bf16_matrix_units() is True
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2\n")
    assert cpu_features.has_bf16_matrix_units() is False
    cpuinfo.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64: not judged here
    assert cpu_features.has_bf16_matrix_units() is None
    cpuinfo.unlink()
    assert cpu_features.has_bf16_matrix_units() is None
