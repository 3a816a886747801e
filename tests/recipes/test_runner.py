"""The recipe runner (scripts/training/run_recipe.py), without starting workers: Bridge's convenience
flags and trailing overrides (trailing wins), ``--config-file`` (overrides, or a whole saved config,
which reloads as the same config), the sequence length synced from the dataset, and bad input as one
``run_recipe.py: error:`` line with exit 2 and nothing written."""

from __future__ import annotations

import os
import warnings

import pytest
import yaml

from megatron_lite.recipes.runner import config_output_path, main, resolve_config, validated_config

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_query_groups=2",
    "model.ffn_hidden_size=128",
    "model.kv_channels=16",
    "-sl",
    "32",
    "-gb",
    "2",
    "-mb",
    "1",
    "-ms",
    "2",
    "--warmup_iters",
    "1",
    "env_vars={}",  # validation would set the recipe's NCCL variables in this process
]


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


def test_convenience_flags_set_bridges_fields_and_a_trailing_override_wins():
    cfg, _ = resolve_config(
        ["--recipe", "llama3_70b_pretrain_config", "-tp", "2", "-pp", "8", "-vp", "1", "--lr", "1e-5"]
        + ["model.pipeline_model_parallel_size=4", "--save_dir", "/tmp/ck"]
    )
    m = cfg.model
    assert (
        m.tensor_model_parallel_size,
        m.pipeline_model_parallel_size,
        m.virtual_pipeline_model_parallel_size,
    ) == (
        2,
        4,
        1,
    )
    assert cfg.optimizer.lr == 1e-5 and cfg.checkpoint.save == "/tmp/ck"
    assert cfg.dist.nproc_per_node == 2 * 4 * 2  # the layout's model-parallel size (cp 2)


def test_the_model_follows_the_datasets_sequence_length():
    cfg, _ = resolve_config(["--recipe", "llama3_8b_pretrain_config", "-sl", "1024"])
    assert cfg.dataset.seq_length == 1024 and cfg.model.seq_length == 1024


def test_a_config_file_of_overrides_goes_under_the_command_lines(tmp_path):
    path = tmp_path / "over.yaml"
    path.write_text(
        yaml.safe_dump({"model": {"num_layers": 4, "hidden_size": 128}, "train": {"train_iters": 9}})
    )
    cfg, _ = resolve_config(["--recipe", "llama3_8b_pretrain_config", "--config-file", str(path), "-ms", "3"])
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.train_iters) == (4, 128, 3)


def test_a_saved_resolved_config_reloads_as_the_same_config(tmp_path):
    cfg, _, _ = _quiet(
        validated_config,
        [
            "--recipe",
            "llama3_70b_pretrain_config",
            *TINY,
            "-tp",
            "1",
            "-cp",
            "1",
            "-pp",
            "2",
            "-vp",
            "1",
            "model.sequence_parallel=false",
        ],
    )
    path = str(tmp_path / "run_config.yaml")
    cfg.to_yaml(path)
    again, _, _ = _quiet(validated_config, ["--config-file", path])
    assert again.to_dict() == cfg.to_dict()
    assert again.model.pipeline_model_parallel_size == 2 and again.mixed_precision.bf16


def test_the_resolved_config_is_saved_beside_the_checkpoints_or_the_logs(tmp_path):
    cfg, _ = resolve_config(["--recipe", "gpt2_small_pretrain_cpu_config", f"checkpoint.save={tmp_path}/ck"])
    assert config_output_path(cfg) == str(tmp_path / "run_config.yaml")
    cfg.checkpoint.save, cfg.logger.tensorboard_dir = None, str(tmp_path / "out" / "tb")
    assert config_output_path(cfg) == str(tmp_path / "out" / "run_config.yaml")


def test_a_dry_run_prints_the_resolved_yaml_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert (
        _quiet(main, ["--recipe", "gpt2_small_pretrain_cpu_config", "--dry-run", "-ms", "3"], "run_recipe.py")
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    printed = yaml.safe_load("\n".join(line for line in out if not line.startswith("run_recipe.py: note:")))
    assert printed["train"]["train_iters"] == 3 and os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--recipe", "llama3_8b_pretrain_confg"], "--recipe: unknown recipe 'llama3_8b_pretrain_confg'"),
        (
            ["--recipe", "llama3_8b_pretrain_config", "model.num_layerz=2"],
            "model.num_layerz: GPTModelProvider",
        ),
        (
            ["--recipe", "llama3_8b_pretrain_config", "train.train_iters=many"],
            "train.train_iters: expects int",
        ),
        (["--recipe", "llama3_8b_pretrain_config", "-tp", "3"], "model.num_attention_heads: 32 heads"),
        (["--config-file", "missing.yaml"], "missing.yaml: cannot be read"),
        (["-tp", "2"], "--recipe: is required"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, argv, said):
    monkeypatch.chdir(tmp_path)
    assert _quiet(main, [*argv, "env_vars={}"], "run_recipe.py") == 2
    err = capsys.readouterr().err
    assert err.startswith("run_recipe.py: error: ") and said in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == []


def test_an_unknown_flag_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--recipe", "llama3_8b_pretrain_config", "--tp", "2"], "run_recipe.py")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("run_recipe.py: error: ") and err.count("\n") == 1


@pytest.mark.parametrize(
    "override, said",
    [
        ("+env_vars.FOO=[1, 2]", "env_vars.FOO: must have a scalar value"),
        ("+env_vars.LD_PRELOAD=/tmp/x.so", "env_vars.LD_PRELOAD: makes a process load code"),
        ("+env_vars.NCCL_NET_PLUGIN=x", "env_vars.NCCL_NET_PLUGIN: makes a process load code"),
    ],
)
def test_environment_variables_a_config_cannot_hold_are_one_line_and_none_is_set(
    tmp_path, monkeypatch, capsys, override, said
):
    monkeypatch.chdir(tmp_path)
    before = dict(os.environ)
    argv = [
        "--recipe",
        "llama3_8b_pretrain_config",
        "--dry-run",
        "env_vars={}",
        "+env_vars.ML_TEST_OK=1",
        override,
    ]
    assert _quiet(main, argv, "run_recipe.py") == 2
    err = capsys.readouterr().err
    assert err.startswith("run_recipe.py: error: ") and said in err and err.count("\n") == 1, err
    assert dict(os.environ) == before and os.listdir(tmp_path) == []


def test_an_output_directory_that_cannot_be_made_is_one_line_before_any_worker(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    save = tmp_path / "a_file" / "checkpoints"  # under a file: cannot be made
    argv = ["--recipe", "gpt2_small_pretrain_cpu_config", *TINY, "--save_dir", str(save)]
    assert _quiet(main, argv, "run_recipe.py") == 2
    err = capsys.readouterr().err
    assert err.startswith("run_recipe.py: error: run_config.yaml: cannot write ") and err.count("\n") == 1, (
        err
    )
