"""Mixed-precision recipes, Megatron-Bridge's ``MixedPrecisionConfig``: a named set of precision
fields that :func:`runtime_config_update` copies onto the model, optimizer and DDP sections.

megatron_lite trains in fp32 or bf16 (fp32 main weights, fp32 gradient reduction), so it registers
upstream's ``bf16_mixed`` and ``fp16_mixed`` (the latter refused with ``--fp16`` by validation). The
FP8 / FP4 recipes need Transformer Engine; their names are refused with that reason, not "unknown".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from megatron_lite.training.errors import ConfigError


@dataclass(kw_only=True)
class MixedPrecisionConfig:
    """Precision fields with upstream's names; :meth:`setup` sets each one the target section has."""

    fp32: bool = False
    fp16: bool = False
    """fp16 compute (megatron_lite refuses it, as ``--fp16``)."""
    bf16: bool = False
    """bf16 parameters and compute with fp32 main weights."""
    params_dtype: torch.dtype | None = None
    """Parameter dtype; None leaves the model's (which follows ``bf16``)."""
    pipeline_dtype: torch.dtype | None = None
    """dtype sent between pipeline stages; None leaves the model's."""
    autocast_dtype: torch.dtype | None = None
    autocast_enabled: bool = False
    grad_reduce_in_fp32: bool = True
    """Reduce gradients in fp32 (megatron_lite's DDP always does)."""
    fp8: str | None = None
    """FP8 format (needs Transformer Engine: refused unless None)."""
    fp8_recipe: str = "tensorwise"
    first_last_layers_bf16: bool = False
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    fp8_param: bool | None = None
    """FP8 parameters; None follows ``fp8_param_gather`` (kept in step with it, as upstream)."""
    fp8_param_gather: bool = False
    fp4: str | None = None
    """FP4 format (needs Transformer Engine: refused unless None)."""
    fp4_recipe: str = "nvfp4"
    fp4_param: bool | None = None
    fp4_param_gather: bool = False
    loss_scale: float | None = None
    """fp16 loss scaling fields (fp16 is refused; kept so upstream recipes construct)."""
    initial_loss_scale: float | None = 4294967296
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    num_layers_at_start_in_bf16: int = 0
    num_layers_at_end_in_bf16: int = 0
    reuse_grad_buf_for_mxfp8_param_ag: bool = False

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        # As upstream: fp8_param and fp8_param_gather (and their fp4 pair) are one setting.
        for a, b in (("fp8_param", "fp8_param_gather"), ("fp4_param", "fp4_param_gather")):
            other = b if name == a else a if name == b else None
            if other is not None and hasattr(self, other) and getattr(self, other) != value:
                object.__setattr__(self, other, value)

    def finalize(self) -> None:
        if self.fp8_param is None:
            self.fp8_param = self.fp8_param_gather
        if self.fp4_param is None:
            self.fp4_param = self.fp4_param_gather
        if self.fp4 and self.fp8:
            raise ConfigError(
                "mixed_precision", "fp4 and fp8 cannot be used simultaneously. Please choose one."
            )
        check_supported_precision(self)

    def setup(self, model_config, optimizer_config=None, ddp_config=None) -> None:
        """Copy every field onto each given section that has a field of that name."""
        for section in (model_config, optimizer_config, ddp_config):
            if section is None:
                continue
            for f in fields(self):
                if hasattr(section, f.name) and getattr(section, f.name) != getattr(self, f.name):
                    setattr(section, f.name, getattr(self, f.name))


def check_supported_precision(mp: MixedPrecisionConfig) -> None:
    """Refuse the fields of precisions megatron_lite does not train in (FP8, FP4)."""
    for name in ("fp8", "fp4"):
        if getattr(mp, name):
            raise ConfigError(
                f"mixed_precision.{name}",
                f"is not supported by megatron_lite: {name.upper()} training needs Transformer Engine; "
                "use the bf16_mixed recipe",
            )


MIXED_PRECISION_RECIPES: dict[str, Callable[[], MixedPrecisionConfig]] = {}

# Upstream's recipes that need Transformer Engine (FP8 / FP4): refused by name with the reason.
TRANSFORMER_ENGINE_RECIPES = (
    "bf16_with_fp8_delayed_scaling_mixed",
    "fp16_with_fp8_delayed_scaling_mixed",
    "bf16_with_mxfp8_mixed",
    "fp16_with_mxfp8_mixed",
    "bf16_with_fp8_current_scaling_mixed",
    "nemotron_h_bf16_with_fp8_current_scaling_mixed",
    "nanov2_bf16_with_fp8_current_scaling_mixed",
    "fp16_with_fp8_current_scaling_mixed",
    "bf16_with_fp8_subchannel_scaling_mixed",
    "fp16_with_fp8_subchannel_scaling_mixed",
    "bf16_with_nvfp4_mixed",
    "nemotron_3_super_bf16_with_nvfp4_mixed",
)


def register(func: Callable[[], MixedPrecisionConfig]) -> Callable[[], MixedPrecisionConfig]:
    """Register a recipe under its function name (and, as upstream, its hyphenated form)."""
    MIXED_PRECISION_RECIPES[func.__name__] = func
    MIXED_PRECISION_RECIPES[func.__name__.replace("_", "-")] = func
    return func


@register
def bf16_mixed() -> MixedPrecisionConfig:
    """bf16 parameters and activations, fp32 main weights and gradient reduction."""
    return MixedPrecisionConfig(
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        autocast_enabled=False,
        grad_reduce_in_fp32=True,
    )


@register
def fp16_mixed() -> MixedPrecisionConfig:
    """fp16 parameters and activations (upstream's recipe; megatron_lite refuses fp16)."""
    return MixedPrecisionConfig(
        fp16=True,
        params_dtype=torch.half,
        pipeline_dtype=torch.half,
        autocast_enabled=False,
        grad_reduce_in_fp32=False,
    )


def get_mixed_precision_config(name: str | MixedPrecisionConfig) -> MixedPrecisionConfig:
    """The recipe called ``name`` (hyphens or underscores), or ``name`` itself if it is a config."""
    if isinstance(name, MixedPrecisionConfig):
        return name
    key = name.replace("-", "_")
    if key in TRANSFORMER_ENGINE_RECIPES:
        raise ConfigError(
            "mixed_precision",
            f"the {key} recipe is not supported by megatron_lite: it needs Transformer Engine "
            "(FP8 / FP4); use bf16_mixed",
        )
    if key not in MIXED_PRECISION_RECIPES:
        valid = ", ".join(sorted(k for k in MIXED_PRECISION_RECIPES if "-" not in k))
        raise ConfigError(
            "mixed_precision", f"Unknown mixed-precision recipe '{key}'. Available recipes: {valid}."
        )
    return MIXED_PRECISION_RECIPES[key]()
