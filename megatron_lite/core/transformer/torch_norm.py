"""The normalization layer a config asks for, as megatron.core.transformer.torch_norm."""

from __future__ import annotations

from torch import nn

from megatron_lite.core.fusions.fused_rms_norm import RMSNorm
from megatron_lite.core.transformer.transformer_config import TransformerConfig

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


class WrappedTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` over ``hidden_size`` from
    ``config.normalization`` and ``config.layernorm_epsilon`` (a factory: the instance is the torch
    module, so state-dict keys stay ``weight`` / ``bias``). Its parameters carry ``sequence_parallel``.
    RMSNorm is ``fusions.fused_rms_norm.RMSNorm``: the same module and values, whose backward keeps
    the input and rstd only, as Transformer Engine's (LayerNorm's already does)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float | None = None) -> nn.Module:
        eps = config.layernorm_epsilon if eps is None else eps
        if config.normalization == "LayerNorm":
            norm = nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"normalization {config.normalization!r}: expected one of {', '.join(NORMALIZATIONS)}"
            )
        for param in norm.parameters():
            # Under sequence parallelism each TP rank normalises only its tokens: the weights' gradients
            # are partial sums, all-reduced over TP by finalize_model_grads.
            param.sequence_parallel = config.sequence_parallel
        return norm
