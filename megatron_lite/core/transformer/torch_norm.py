"""The normalization layer a config asks for, as megatron.core.transformer.torch_norm."""

from __future__ import annotations

from torch import nn

from megatron_lite.core.transformer.transformer_config import TransformerConfig

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` over ``hidden_size`` from
    ``config.normalization`` and ``config.layernorm_epsilon`` (a factory: the instance is the torch
    module, so state-dict keys stay ``weight`` / ``bias``)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> nn.Module:
        eps = config.layernorm_epsilon if eps is None else eps
        if config.normalization == "LayerNorm":
            return nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        if config.normalization == "RMSNorm":
            return nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        raise ValueError(
            f"normalization {config.normalization!r}: expected one of {', '.join(NORMALIZATIONS)}"
        )
