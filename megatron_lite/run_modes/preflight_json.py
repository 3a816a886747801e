"""The preflight's judgement and its record: which predictions a job is judged on, each stage's peak and
whether it fits with the reserve (one set of functions the preflight and the layout planner both call),
``--memory-preflight-json``'s data and the file it goes to (refused before anything runs when it
cannot be written)."""

from __future__ import annotations

import os

from megatron_lite.training.errors import ConfigError
from megatron_lite.training.memory.predict.moe import judged_routing
from megatron_lite.training.memory.table import preflight_activation_bytes

# The share of the device kept for what no tensor shows (the CUDA context, NCCL's buffers, the caching
# allocator's rounding and fragmentation).
RESERVE_FRACTION = 0.10


def usable_gb(capacity_gb: float) -> float:
    """What a stage's allocated peak may reach on a ``capacity_gb`` device: all of it but the reserve."""
    return capacity_gb * (1 - RESERVE_FRACTION)


def judged_predictions(config):
    """(the predictions the verdict judges, balanced routing's beside them or None), for a CUDA job: a
    MoE model whose routed rows are open is judged on its worst routing (predict/moe.py's
    ``judged_routing``)."""
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    if judged_routing(config.model) != "worst":
        return predict_memory_per_stage(config, device_type="cuda"), None
    worst = predict_memory_per_stage(config, device_type="cuda", routing="worst")
    return worst, predict_memory_per_stage(config, device_type="cuda", routing="balanced")


def stage_peaks(predictions, dry=None) -> list[int]:
    """Per stage: the predicted allocated peak, or with a dry run the larger of it and the measured one."""
    if not dry:
        return [p.peak_bytes for p in predictions]
    return [max(p.peak_bytes, d.max_allocated_bytes) for p, d in zip(predictions, dry)]


def stage_fits(predictions, capacity_gb: float, dry=None) -> list[bool]:
    """Per stage: whether its peak (:func:`stage_peaks`) leaves the reserve free."""
    return [peak / 1e9 <= usable_gb(capacity_gb) for peak in stage_peaks(predictions, dry)]


def preflight_record(
    predictions,
    capacity_gb: float,
    fits: bool,
    recommendation: str | None,
    dry=None,
    confirmed=None,
    balanced=None,
    moe_routing: str | None = None,
) -> dict:
    """The preflight as data (``--memory-preflight-json``): per stage the predicted allocated peak and
    its parts, in bytes, and with ``dry`` the dry run's measured peak; the device; the verdict; the
    flags to add ("" when it fits as given, None when no combination of the levers fits) and, when
    the dry run measured them, whether they fit (``recommendation_confirmed``). A MoE model's
    ``moe_routing`` says what the figures are: "worst" (the worst routing's bound, judged; balanced
    routing's peak and activations beside, ``*_balanced``) or "exact" (padded to capacity). A LoRA
    run's stages also hold ``adapter_weights_bytes`` (the adapters' part of ``weights_bytes``)."""
    stages = [
        {
            "stage": i,
            "predicted_max_allocated_bytes": p.peak_bytes,
            **({"dry_run_max_allocated_bytes": dry[i].max_allocated_bytes} if dry else {}),
            "weights_bytes": p.weights_bytes,
            **({"adapter_weights_bytes": p.adapter_weights_bytes} if p.adapter_weights_bytes else {}),
            "grads_bytes": p.grads_bytes,
            "optimizer_bytes": p.optimizer_state_bytes,
            "activations_bytes": preflight_activation_bytes(p),
            "temporaries_bytes": p.temporaries_bytes,
            **(
                {
                    "predicted_max_allocated_bytes_balanced": balanced[i].peak_bytes,
                    "activations_bytes_balanced": preflight_activation_bytes(balanced[i]),
                }
                if balanced
                else {}
            ),
        }
        for i, p in enumerate(predictions)
    ]
    return {
        "stages": stages,
        **({} if moe_routing is None else {"moe_routing": moe_routing}),
        "device_bytes": int(capacity_gb * 1e9),
        "reserve_fraction": RESERVE_FRACTION,
        "fits": fits,
        "recommendation": recommendation,
        **({} if confirmed is None else {"recommendation_confirmed": confirmed}),
    }


def json_path_arg(value: str | None, flag: str = "--memory-preflight-json") -> str:
    """A FILE the preflight writes (``flag``'s: --memory-preflight-json, --memory-preflight-html), refused
    before anything runs when it cannot be written there."""
    if not value or value.startswith("-"):
        raise ConfigError(flag, "needs a FILE to write to")
    directory = os.path.dirname(os.path.abspath(value))
    if os.path.isdir(value) or not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ConfigError(flag, f"cannot write {value}: {directory} is not a writable directory")
    return value
