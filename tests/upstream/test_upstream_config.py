"""Upstream's config surface (megatron.bridge.training.config): sections, finalize(), validate().

Written in upstream's mocked style: the world size comes from a patched ``get_world_size_safe``,
optional packages from a patched ``importlib.import_module``; nothing starts processes.
"""

from __future__ import annotations

import os
import warnings

import pytest

import megatron_lite.training.config as config_module
from megatron_lite.models.gpt_provider import GPTModelProvider
from megatron_lite.training.arguments import parse_args
from megatron_lite.training.config import (
    CheckpointConfig,
    ConfigContainer,
    ConfigError,
    GPTDatasetConfig,
    LoggerConfig,
    MixedPrecisionConfig,
    MockGPTDatasetConfig,
    OptimizerConfig,
    ProfilingConfig,
    SchedulerConfig,
    TrainingConfig,
    ValidationConfig,
    apply_environment_variables,
    runtime_config_update,
)


def _container(world_size, mocker, *, seq=128, **sections) -> ConfigContainer:
    mocker.patch.object(config_module, "get_world_size_safe", return_value=world_size)
    defaults = dict(
        model=GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=seq),
        train=TrainingConfig(micro_batch_size=1, global_batch_size=32, train_iters=100),
        optimizer=OptimizerConfig(lr=1e-4),
        scheduler=SchedulerConfig(),
        dataset=GPTDatasetConfig(
            seq_length=seq,
            random_seed=1,
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
        ),
        logger=LoggerConfig(),
        checkpoint=CheckpointConfig(),
    )
    defaults.update(sections)
    return ConfigContainer(**defaults)


def test_config_error_is_upstreams_exception_types_and_one_line():
    err = ConfigError("--num-layers", "must be positive")
    assert isinstance(err, AssertionError) and isinstance(err, ValueError)
    assert str(err) == "--num-layers: must be positive" and err.flag == "--num-layers"


def test_section_defaults_are_upstreams_and_container_default_is_the_demo():
    t = TrainingConfig()
    assert (t.micro_batch_size, t.global_batch_size, t.train_iters, t.train_samples) == (None,) * 4
    assert LoggerConfig().log_interval == 100 and ValidationConfig().eval_iters == 100
    demo = ConfigContainer()
    assert (demo.train.train_iters, demo.logger.log_interval, demo.validation.eval_iters) == (100, 10, 10)
    assert demo.checkpoint.ckpt_format == "torch"


def test_validate_derives_data_parallel_size_from_world_size(mocker):
    cfg = _container(
        8,
        mocker,
        model=GPTModelProvider(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, tensor_model_parallel_size=2
        ),
    )
    cfg.validate()
    assert cfg.data_parallel_size == 4 and cfg.num_microbatches == 8
    bad = _container(
        6,
        mocker,
        model=GPTModelProvider(
            num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, tensor_model_parallel_size=4
        ),
    )
    with pytest.raises(AssertionError, match="is not divisible by") as exc:
        bad.validate()
    assert exc.value.flag == "--nproc-per-node"


def test_train_samples_become_iterations_and_sample_steps(mocker):
    cfg = _container(
        1,
        mocker,
        train=TrainingConfig(micro_batch_size=1, global_batch_size=32, train_samples=3200),
        scheduler=SchedulerConfig(lr_decay_samples=2000, lr_warmup_samples=100),
    )
    cfg.validate()
    cfg.validate()  # idempotent: the derived train_iters does not count as a second training mode
    assert cfg.train.train_iters == 100
    s = cfg.scheduler
    assert (s.lr_decay_steps, s.lr_warmup_steps, s.wd_incr_steps) == (2000, 100, 3200)


def test_iteration_and_sample_scheduler_fields_do_not_mix(mocker):
    with pytest.raises(AssertionError, match="Cannot mix iteration-based and sample-based"):
        SchedulerConfig(lr_decay_iters=10, lr_decay_samples=100).finalize()
    cfg = _container(1, mocker, scheduler=SchedulerConfig(lr_decay_samples=100))
    with pytest.raises(ConfigError, match="Use lr_decay_iters for iteration-based training"):
        cfg.validate()
    with pytest.raises(AssertionError, match="Cannot specify more than one"):
        TrainingConfig(global_batch_size=8, train_iters=10, train_samples=80).finalize()


def test_max_steps_stretches_the_schedule_and_must_cover_training(mocker):
    cfg = _container(1, mocker, scheduler=SchedulerConfig(max_steps=400))
    cfg.validate()
    assert cfg.scheduler.lr_decay_iters == 400 and cfg.scheduler.lr_decay_steps == 400 * 32
    short = _container(1, mocker, scheduler=SchedulerConfig(max_steps=50))
    with pytest.raises(ValueError, match="must be greater than or equal to train.train_iters"):
        short.validate()


def test_warmup_longer_than_decay_is_capped_with_a_warning(mocker):
    cfg = _container(
        1,
        mocker,
        train=TrainingConfig(micro_batch_size=1, global_batch_size=32, train_iters=4),
        scheduler=SchedulerConfig(lr_warmup_iters=10),
    )
    with pytest.warns(UserWarning, match="capping lr_warmup_steps"):
        cfg.validate()
    assert cfg.scheduler.lr_warmup_steps == cfg.scheduler.lr_decay_steps - 1 == 127


def test_eval_batch_sizes_default_to_training_and_must_divide(mocker):
    cfg = _container(4, mocker)
    cfg.validate()
    assert (cfg.validation.eval_global_batch_size, cfg.validation.eval_micro_batch_size) == (32, 1)
    bad = _container(
        4, mocker, validation=ValidationConfig(eval_global_batch_size=6, eval_micro_batch_size=1)
    )
    with pytest.raises(AssertionError, match="eval_global_batch_size.*must be divisible by") as exc:
        bad.validate()
    assert exc.value.flag == "validation.eval_global_batch_size"


def test_context_parallel_needs_two_chunks_per_rank(mocker):
    m = GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=126, context_parallel_size=2
    )
    cfg = _container(2, mocker, seq=126, model=m)
    with pytest.raises(AssertionError, match="divisible by 2 \\* context parallel size"):
        cfg.validate()


def test_model_and_dataset_sequence_lengths_must_match(mocker):
    cfg = _container(1, mocker)
    cfg.dataset.seq_length = 64
    with pytest.raises(AssertionError, match="model config and dataset config match"):
        cfg.validate()


def test_dataset_finalize_is_deferred_and_idempotent():
    ds = GPTDatasetConfig(
        seq_length=32,
        random_seed=3,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    assert ds.split is None and ds.sequence_length == 32
    ds.finalize()
    snapshot = repr(ds)
    ds.finalize()
    assert ds.mock and ds.split == "1,1,1" and repr(ds) == snapshot
    ds.reset_position_ids = None
    with pytest.raises(AssertionError, match="reset_position_ids must be defined"):
        ds.finalize()
    with pytest.raises(ValueError, match="seq_length"):
        GPTDatasetConfig(random_seed=1)


def test_mock_dataset_refuses_a_blend():
    ds = MockGPTDatasetConfig(
        seq_length=16,
        random_seed=1,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        blend=(["a"], None),
    )
    with pytest.raises(TypeError, match="unexpected keyword argument 'blend'"):
        ds.finalize()


def test_logger_finalize_pairs_and_packages(mocker):
    with pytest.raises(ValueError, match="Set logger.mlflow_run_name") as exc:
        LoggerConfig(mlflow_experiment="e").finalize()
    assert exc.value.flag == "--mlflow-run-name"
    mocker.patch("importlib.import_module", side_effect=ModuleNotFoundError("No module named 'comet_ml'"))
    with pytest.raises(ModuleNotFoundError, match="comet_ml") as missing:
        LoggerConfig(comet_workspace="w").finalize()
    assert isinstance(missing.value, ConfigError)


def test_mixed_precision_and_distributed_optimizer_checks(mocker):
    cfg = _container(1, mocker, optimizer=OptimizerConfig(lr=1e-4, bf16=True, fp16=True))
    with pytest.raises(AssertionError, match="Optimizer config cannot have both bf16=True and fp16=True"):
        cfg.validate()
    cfg = _container(1, mocker, optimizer=OptimizerConfig(lr=1e-4, use_distributed_optimizer=True))
    with pytest.warns(UserWarning, match="not in sync"):
        cfg.validate()
    assert cfg.ddp.use_distributed_optimizer  # synced, as upstream


@pytest.mark.parametrize(
    "change,flag",
    [
        (
            lambda c: (
                setattr(c.checkpoint, "save", "ck") or setattr(c.checkpoint, "ckpt_format", "fsdp_dtensor")
            ),
            "--ckpt-format",
        ),
        (
            lambda c: setattr(c, "profiling", ProfilingConfig(pytorch_profiler_collect_chakra=True)),
            "--pytorch-profiler-collect-chakra",
        ),
        (lambda c: setattr(c, "mixed_precision", MixedPrecisionConfig(fp8="hybrid")), "mixed_precision.fp8"),
        (lambda c: setattr(c.train, "rampup_batch_size", [8, 8, 100]), "--rampup-batch-size"),
    ],
)
def test_features_not_built_are_refused_by_name(mocker, change, flag):
    cfg = _container(1, mocker)
    change(cfg)
    with pytest.raises(ConfigError) as exc:
        cfg.validate()
    assert exc.value.flag == flag and "not supported" in str(exc.value)


def test_lazy_mpu_init_implies_cpu_initialization(mocker):
    cfg = _container(1, mocker)
    cfg.dist.lazy_mpu_init = True
    cfg.validate()
    assert cfg.model.use_cpu_initialization is True and cfg.dist.lazy_init


def test_environment_defaults_keep_launcher_values(mocker, monkeypatch, restored_environment):
    monkeypatch.setenv("ML_TEST_KEEP", "launcher")
    monkeypatch.delenv("ML_TEST_NEW", raising=False)
    cfg = _container(1, mocker)
    cfg.env_vars = {"ML_TEST_KEEP": "recipe", "ML_TEST_NEW": 3}
    runtime_config_update(cfg)
    assert os.environ["ML_TEST_KEEP"] == "launcher" and os.environ["ML_TEST_NEW"] == "3"
    cfg.env_vars = {"ML_TEST_BAD": ["x"]}
    with pytest.raises(TypeError):
        apply_environment_variables(cfg)


def test_yaml_round_trip_keeps_sections(mocker, tmp_path):
    cfg = _container(1, mocker)
    cfg.env_vars = {"A": "1"}
    cfg.model.bf16 = True
    path = tmp_path / "run.yaml"
    cfg.to_yaml(str(path))
    back = ConfigContainer.from_yaml(str(path))
    assert back.env_vars == {"A": "1"} and type(back.dataset) is GPTDatasetConfig
    assert back.train == cfg.train and back.scheduler == cfg.scheduler and back.logger == cfg.logger
    assert back.model.bf16 and back.model.seq_length == 128 and back.model.init_method is not None


def test_cli_train_samples_and_validation_flags(capsys):
    cfg = parse_args(["--train-samples", "160", "--eval-iters", "3", "--eval-interval", "5"])
    assert cfg.train.train_iters == 10 and cfg.train.train_samples == 160
    assert (cfg.validation.eval_iters, cfg.validation.eval_interval) == (3, 5)
    assert cfg.scheduler.lr_decay_steps == 160
    with pytest.raises(SystemExit) as exc:
        parse_args(["--save", "ck", "--ckpt-format", "fsdp_dtensor"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ckpt-format" in err


def test_scheduler_uses_the_steps_validate_derived(mocker):
    from megatron_lite.training import setup

    cfg = _container(
        1,
        mocker,
        train=TrainingConfig(micro_batch_size=1, global_batch_size=32, train_samples=3200),
        scheduler=SchedulerConfig(lr_decay_samples=1600, lr_warmup_fraction=0.25),
    )
    cfg.validate()
    sched = mocker.patch.object(setup, "OptimizerParamScheduler")
    setup.get_optimizer_param_scheduler(cfg, object())
    kwargs = sched.call_args.kwargs
    assert (kwargs["lr_decay_steps"], kwargs["lr_warmup_steps"]) == (1600, 400)


def test_evaluate_uses_the_validation_batch_sizes(mocker):
    from megatron_lite.training import eval as eval_module

    cfg = _container(
        2,
        mocker,
        validation=ValidationConfig(eval_iters=2, eval_global_batch_size=8, eval_micro_batch_size=2),
    )
    cfg.validate()
    calls = []
    mocker.patch.object(
        eval_module, "get_forward_backward_func", return_value=lambda **kw: calls.append(kw) or []
    )
    mocker.patch.object(eval_module, "prepare_forward_step_func", side_effect=lambda f, s: f)
    mocker.patch.object(eval_module.parallel_state, "is_pipeline_last_stage", return_value=False)
    state = mocker.MagicMock()
    state.train_state.consumed_valid_samples = 0
    model = mocker.MagicMock()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eval_module.evaluate(None, iter([]), model, cfg, state, None)
    assert [(c["num_microbatches"], c["micro_batch_size"]) for c in calls] == [(2, 2), (2, 2)]
    assert state.train_state.consumed_valid_samples == 16
