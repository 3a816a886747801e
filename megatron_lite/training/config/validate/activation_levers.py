"""Checks of the activation-memory levers (recomputation, sequence parallelism), run by validate with
the other config checks: each failure is one ConfigError naming the flag and the fix."""

from __future__ import annotations

from megatron_lite.core.transformer.pipeline_layer_split import layers_per_pipeline_stage
from megatron_lite.training.errors import ConfigError

RECOMPUTE_MODULES = ("core_attn", "mlp")


def check_activation_levers(cfg) -> None:
    m = cfg.model
    if m.cross_entropy_fusion_impl not in ("native", "te"):
        raise ConfigError(
            "--cross-entropy-fusion-impl", f"must be native or te, got {m.cross_entropy_fusion_impl!r}"
        )
    if m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "te":
        raise ConfigError("--cross-entropy-fusion-impl", "te needs Transformer Engine; use native")
    granularity, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    if granularity not in (None, "full", "selective"):
        raise ConfigError("--recompute-granularity", f"must be full or selective, got {granularity!r}")
    if method is not None and granularity != "full":
        raise ConfigError("--recompute-method", "needs --recompute-granularity full")
    if n is not None and granularity != "full":
        raise ConfigError("--recompute-num-layers", "needs --recompute-granularity full")
    if granularity == "full":
        if method not in ("uniform", "block"):
            raise ConfigError(
                "--recompute-method",
                f"must be uniform or block with --recompute-granularity full, got {method!r}",
            )
        if n is None:
            raise ConfigError("--recompute-num-layers", "is required with --recompute-granularity full")
        # Checked after the layer split (check_divisibility): every stage's count is known here.
        layers_per_stage = max(layers_per_pipeline_stage(m))
        if not 1 <= n <= layers_per_stage:
            raise ConfigError(
                "--recompute-num-layers",
                f"{n} must be between 1 and the {layers_per_stage} layers of the largest pipeline stage",
            )
    modules = list(m.recompute_modules or ["core_attn"])
    unknown = [name for name in modules if name not in RECOMPUTE_MODULES]
    if unknown:
        raise ConfigError(
            "--recompute-modules",
            f"{unknown[0]!r} is not one of {', '.join(RECOMPUTE_MODULES)} (megatron_lite)",
        )
    if modules != ["core_attn"] and granularity != "selective":
        raise ConfigError("--recompute-modules", "needs --recompute-granularity selective")
    if m.distribute_saved_activations:
        if granularity != "full":
            raise ConfigError("--distribute-saved-activations", "needs --recompute-granularity full")
        if m.sequence_parallel:
            raise ConfigError(
                "--distribute-saved-activations",
                "cannot be combined with --sequence-parallel (its inputs are already split)",
            )
    if m.sequence_parallel:
        tp, cp = m.tensor_model_parallel_size, m.context_parallel_size
        if tp == 1:
            raise ConfigError("--sequence-parallel", "needs --tensor-model-parallel-size > 1")
        local = m.seq_length // cp
        if local % tp:
            raise ConfigError(
                "--sequence-parallel",
                f"each context-parallel rank's {local} tokens do not split over "
                f"--tensor-model-parallel-size {tp}; use a --seq-length divisible by {cp * tp}",
            )
