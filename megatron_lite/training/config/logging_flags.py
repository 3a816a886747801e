"""Megatron-LM's logging and profiling flags, a part of the one flag table (flags.py joins them in)."""

from __future__ import annotations

# The sinks (TensorBoard, W&B, MLflow, Comet), what they are sent and the memory reports.
LOGGING_FLAGS: list[tuple[str, str, str | None, object, str]] = [
    ("--log-interval", "logger", "log_interval", int, "Iterations between console lines."),
    ("--log-throughput", "logger", "log_throughput", "store_true", "Print model TFLOP/s per GPU."),
    (
        "--log-throughput-to-tensorboard",
        "logger",
        "log_throughput_to_tensorboard",
        "store_true",
        "Log throughput/* (windowed batches, samples, tokens per second; TFLOP/s) to the loggers.",
    ),
    ("--throughput-window-size", "logger", "throughput_window_size", int, "Iterations in the window."),
    ("--timing-log-level", "logger", "timing_log_level", int, "Timers to log: 0 none, 1 step, 2 all."),
    ("--log-params-norm", "logger", "log_params_norm", "store_true", "Compute and log the parameter norm."),
    ("--tensorboard-dir", "logger", "tensorboard_dir", str, "TensorBoard directory."),
    (
        "--tensorboard-log-interval",
        "logger",
        "tensorboard_log_interval",
        int,
        "Iterations between logger writes.",
    ),
    ("--tensorboard-queue-size", "logger", "tensorboard_queue_size", int, "SummaryWriter queue size."),
    ("--log-timers-to-tensorboard", "logger", "log_timers_to_tensorboard", "store_true", "Log timers."),
    (
        "--log-memory-to-tensorboard",
        "logger",
        "log_memory_to_tensorboard",
        "store_true",
        "Log memory: each metric's peak across all pipeline stages.",
    ),
    (
        "--log-memory-per-pp-stage",
        "logger",
        "log_memory_per_pp_stage",
        "store_true",
        "Also log memory/pp-stage-<i>/<name> for every stage.",
    ),
    (
        "--no-log-loss-scale-to-tensorboard",
        "logger",
        "log_loss_scale_to_tensorboard",
        "store_false",
        "Do not log the loss scale.",
    ),
    ("--wandb-project", "logger", "wandb_project", str, "W&B project."),
    ("--wandb-exp-name", "logger", "wandb_exp_name", str, "W&B run name."),
    ("--wandb-save-dir", "logger", "wandb_save_dir", str, "W&B local directory."),
    ("--wandb-entity", "logger", "wandb_entity", str, "W&B entity."),
    ("--mlflow-experiment", "logger", "mlflow_experiment", str, "MLflow experiment."),
    ("--mlflow-run-name", "logger", "mlflow_run_name", str, "MLflow run name."),
    ("--mlflow-tracking-uri", "logger", "mlflow_tracking_uri", str, "MLflow tracking URI."),
    ("--comet-project", "logger", "comet_project", str, "Comet project."),
    ("--comet-experiment-name", "logger", "comet_experiment_name", str, "Comet experiment name."),
    ("--comet-workspace", "logger", "comet_workspace", str, "Comet workspace."),
    ("--comet-offline-directory", "logger", "comet_offline_directory", str, "Write Comet offline here."),
]

# Profiler flags (config.profiling, None unless --profile): (flag, field, type, help).
PROFILING_FLAGS: list[tuple[str, str, object, str]] = [
    ("--use-pytorch-profiler", "use_pytorch_profiler", "store_true", "torch.profiler, not Nsight Systems."),
    ("--profile-step-start", "profile_step_start", int, "Global step to start profiling (default: 10)."),
    ("--profile-step-end", "profile_step_end", int, "Global step to stop profiling (default: 12)."),
    ("--profile-ranks", "profile_ranks", "+", "Global ranks to profile (default: 0)."),
    ("--pytorch-profiler-collect-shapes", "pytorch_profiler_collect_shapes", "store_true", "Record shapes."),
    ("--pytorch-profiler-collect-callstack", "pytorch_profiler_collect_callstack", "store_true", "Stacks."),
    ("--pytorch-profiler-collect-chakra", "pytorch_profiler_collect_chakra", "store_true", "Chakra traces."),
    ("--record-shapes", "record_shapes", "store_true", "Shapes in Nsight Systems' NVTX ranges."),
]
