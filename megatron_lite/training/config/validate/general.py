"""megatron_lite's own checks of a ConfigContainer, run by validate after upstream's.

Upstream's checks (in ConfigContainer.validate and each section's finalize) say whether a config is
coherent; these say whether megatron_lite can run it: features not built yet are refused by name
(the layout's divisibility is validate/layout.py's). Each failure is one ConfigError naming the flag and the fix. Pure:
they read the config (and /proc/cpuinfo: --bf16 on a CPU without bf16 units is a warning, which
parse_args prints as one note) and write nothing.
"""

from __future__ import annotations

import warnings

import torch

from megatron_lite.training.config.mixed_precision import check_supported_precision
from megatron_lite.training.errors import ConfigError
from megatron_lite.utils.cpu_features import has_bf16_matrix_units

_SUPPORTED_DECAY_STYLES = ("constant", "linear", "cosine")


def _refuse(flags: dict[str, bool]) -> None:
    for flag, bad in flags.items():
        if bad:
            raise ConfigError(flag, "is not supported yet by megatron_lite")


def check_supported(cfg) -> None:
    """Refuse every field of a feature megatron_lite does not have, set away from its default."""
    m, t, o, d, ck = cfg.model, cfg.train, cfg.optimizer, cfg.ddp, cfg.checkpoint
    ds, tok = cfg.dataset, cfg.tokenizer
    _refuse(
        {
            "--fp16": m.fp16 or o.fp16,
            "--apply-rope-fusion": getattr(m, "apply_rope_fusion", False),
            "--use-precision-aware-optimizer": o.use_precision_aware_optimizer,
            "--decoupled-lr": o.decoupled_lr is not None,
            "--use-megatron-fsdp": d.use_megatron_fsdp or cfg.dist.use_megatron_fsdp,
            "--use-torch-fsdp2": cfg.dist.use_torch_fsdp2,
            "--use-tp-pp-dp-mapping": cfg.dist.use_tp_pp_dp_mapping,
            "--eval-context-parallel-size": cfg.dist.eval_context_parallel_size is not None,
            "--te-rng-tracker": cfg.rng.te_rng_tracker or cfg.rng.inference_rng_tracker,
            "--data-parallel-random-init": cfg.rng.data_parallel_random_init,
            "--rampup-batch-size": t.rampup_batch_size is not None,
            "--num-epochs": t.num_epochs is not None,
            "--exit-duration-in-mins": t.exit_duration_in_mins is not None,
            "--skip-train": bool(cfg.validation.skip_train),
            "--dataloader-type": ds.dataloader_type not in (None, "single"),
            "--tokenizer-metadata": tok.metadata_path is not None,
            "--no-save-optim": not ck.save_optim,
            "--no-save-rng": not ck.save_rng,
            "--rerun-mode": cfg.rerun_state_machine.rerun_mode != "disabled",
            "--error-injection-rate": cfg.rerun_state_machine.error_injection_rate != 0,
            "--check-for-spiky-loss": cfg.rerun_state_machine.check_for_spiky_loss,
        }
    )
    if getattr(ds, "reset_attention_mask", False):
        raise ConfigError(
            "--reset-attention-mask",
            "is not supported yet by megatron_lite: its attention is causal over the whole sequence and "
            "takes no per-document mask (--reset-position-ids and --eod-mask-loss are supported)",
        )
    if getattr(m, "calculate_per_token_loss", False) and d.average_in_collective:
        raise ConfigError(
            "--calculate-per-token-loss",
            "cannot average in the collective (ddp average_in_collective), as upstream",
        )
    if d.overlap_param_gather and not (d.use_distributed_optimizer or o.use_distributed_optimizer):
        raise ConfigError("--overlap-param-gather", "needs --use-distributed-optimizer (as upstream)")
    if (
        d.use_distributed_optimizer or o.use_distributed_optimizer
    ) and cfg.logger.log_l2_norm_grad_to_tensorboard:
        raise ConfigError(
            "--use-distributed-optimizer",
            "logger.log_l2_norm_grad_to_tensorboard needs each parameter's whole reduced gradient, "
            "but the distributed optimizer reduces only each rank's shard",
        )
    if d.bucket_size is not None and d.bucket_size <= 0:
        raise ConfigError("--ddp-bucket-size", f"must be positive, got {d.bucket_size}")
    if ck.ckpt_format not in ("torch", "torch_dist"):
        raise ConfigError(
            "--ckpt-format",
            f"{ck.ckpt_format!r} is not supported; megatron_lite saves 'torch' (legacy) or 'torch_dist' "
            "(and loads either, whatever --ckpt-format says)",
        )
    if ck.async_save and ck.ckpt_format != "torch_dist":
        raise ConfigError("--async-save", "is only supported with --ckpt-format torch_dist (as upstream)")
    if ck.async_save and not ck.use_persistent_ckpt_worker:
        raise ConfigError("--async-save", "async_save requires use_persistent_ckpt_worker=True.")
    p = cfg.profiling
    if p is not None:
        _refuse(
            {
                "--pytorch-profiler-collect-chakra": p.pytorch_profiler_collect_chakra,
            }
        )
        if p.record_memory_history and not torch.cuda.is_available():
            raise ConfigError(
                "--record-memory-history",
                "records the CUDA caching allocator's history, which needs CUDA; this machine has no GPU "
                "(on CPU the memory/* dashboards and the OOM post-mortem still explain memory)",
            )
        if p.use_nsys_profiler and not torch.cuda.is_available():
            raise ConfigError(
                "--profile",
                "alone records with Nsight Systems, which needs CUDA; add --use-pytorch-profiler on CPU",
            )
        if (p.use_pytorch_profiler or p.use_nsys_profiler) and (
            cfg.train.train_iters or 0
        ) < p.profile_step_end:
            raise ConfigError(
                "--profile-step-end",
                f"{p.profile_step_end} is past --train-iters {cfg.train.train_iters}: the profile would never end",
            )
    if m.bf16 and not torch.cuda.is_available() and has_bf16_matrix_units() is False:
        warnings.warn(
            "--bf16 on a CPU without bf16 matrix instructions (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
            "its matmuls take ATen's generic GEMM, many times slower than fp32 on this machine "
            "(bench/pipeline_vs_torch_pipelining.py prints the ratio)",
            stacklevel=2,
        )
    if isinstance(cfg.mixed_precision, str):
        raise ConfigError(
            "mixed_precision",
            f"the recipe name {cfg.mixed_precision!r} is applied by runtime_config_update(cfg) "
            "(which then validates), not by validate() alone",
        )
    if cfg.mixed_precision is not None:
        check_supported_precision(cfg.mixed_precision)
    for name in (
        "comm_overlap",
        "ft",
        "straggler",
        "nvrx_straggler",
        "tensor_inspect",
    ):
        if getattr(cfg, name) is not None:
            raise ConfigError(name, "is not supported yet by megatron_lite; leave it None")
    if cfg.inprocess_restart is not None and getattr(cfg.inprocess_restart, "enabled", True):
        raise ConfigError("inprocess_restart", "is not supported yet by megatron_lite; leave it None")


def check_ranges(cfg) -> None:
    m, t, o, s, v, lg = cfg.model, cfg.train, cfg.optimizer, cfg.scheduler, cfg.validation, cfg.logger
    positive = {
        "--num-layers": m.num_layers,
        "--hidden-size": m.hidden_size,
        "--num-attention-heads": m.num_attention_heads,
        "--ffn-hidden-size": m.ffn_hidden_size,
        "--seq-length": getattr(cfg.dataset, "seq_length", m.seq_length),
        "--max-position-embeddings": m.max_position_embeddings or m.seq_length,
        "--vocab-size": m.vocab_size,
        "--micro-batch-size": t.micro_batch_size,
        "--global-batch-size": t.global_batch_size,
        "--train-iters": t.train_iters,
        "--tensor-model-parallel-size": m.tensor_model_parallel_size,
        "--pipeline-model-parallel-size": m.pipeline_model_parallel_size,
        "--context-parallel-size": m.context_parallel_size,
        "--log-interval": lg.log_interval,
        "--tensorboard-log-interval": lg.tensorboard_log_interval,
        "--tensorboard-queue-size": lg.tensorboard_queue_size,
        "--distributed-timeout-minutes": cfg.dist.distributed_timeout_minutes,
    }
    optional_positive = {
        "--nproc-per-node": cfg.dist.nproc_per_node,
        "--save-interval": cfg.checkpoint.save_interval,
        "--exit-interval": t.exit_interval,
        "--eval-interval": v.eval_interval,
        "--lr-decay-iters": s.lr_decay_iters,
        "--lr-decay-samples": s.lr_decay_samples,
    }
    for flag, value in {**positive, "--eval-iters": v.eval_iters}.items():
        if value is None:
            raise ConfigError(flag, "must be set")
    for flag, value in {**positive, **{k: x for k, x in optional_positive.items() if x is not None}}.items():
        if value <= 0:
            raise ConfigError(flag, f"must be a positive integer, got {value}")
    if o.min_lr > o.lr:
        raise ConfigError("--min-lr", f"must not exceed --lr ({o.min_lr} > {o.lr})")
    if s.lr_decay_style not in _SUPPORTED_DECAY_STYLES:
        raise ConfigError("--lr-decay-style", f"must be constant, linear or cosine, got {s.lr_decay_style!r}")
    mpe = m.max_position_embeddings or m.seq_length
    if m.seq_length > mpe:
        raise ConfigError(
            "--seq-length",
            f"{m.seq_length} exceeds --max-position-embeddings {mpe}; "
            "lower --seq-length or raise --max-position-embeddings",
        )
    if cfg.dist.distributed_backend not in (None, "gloo", "nccl"):
        raise ConfigError("--distributed-backend", "must be gloo or nccl")
    if cfg.dist.distributed_backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend", "nccl needs CUDA GPUs and none are visible; use gloo")


def check_logger(cfg) -> None:
    lg = cfg.logger
    pairs = [
        ("--wandb-project", lg.wandb_project, "--wandb-exp-name", lg.wandb_exp_name),
        ("--mlflow-experiment", lg.mlflow_experiment, "--mlflow-run-name", lg.mlflow_run_name),
        ("--comet-project", lg.comet_project, "--comet-experiment-name", lg.comet_experiment_name),
    ]
    for flag, project, name_flag, name in pairs:
        if project is not None and not project.strip():
            raise ConfigError(flag, "must not be empty")
        if project and not name:
            raise ConfigError(name_flag, f"is required with {flag}; give the run a name")
        if name and not project:
            raise ConfigError(flag, f"is required with {name_flag}")
    if lg.wandb_project:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project", "needs the 'wandb' package: pip install wandb")
    if lg.log_memory_per_pp_stage and not lg.log_memory_to_tensorboard:
        raise ConfigError("--log-memory-per-pp-stage", "needs --log-memory-to-tensorboard")
    if cfg.checkpoint.save_interval and not cfg.checkpoint.save:
        raise ConfigError("--save-interval", "needs --save DIR")
