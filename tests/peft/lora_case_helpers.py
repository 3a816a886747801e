"""Tiny models and a hand-computed LoRA for the tests under tests/peft (not a test module)."""

from __future__ import annotations

import torch

from megatron_lite.core.models.gpt.gpt_model import GPTModel
from megatron_lite.core.transformer.transformer_config import TransformerConfig

SEQ, VOCAB = 16, 128


def tiny_gpt(**overrides) -> GPTModel:
    """A two-layer GPT with hidden size 32 (extra TransformerConfig fields in ``overrides``)."""
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    fields.update(overrides)
    return GPTModel(TransformerConfig(**fields), VOCAB, SEQ)


def tokens_and_positions(seed: int = 3, batch: int = 2):
    tokens = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
    return tokens, torch.arange(SEQ).expand_as(tokens)


def randomize_adapters(model, seed: int = 0) -> None:
    """Give every adapter weight (B included, zero at first) random values, so it changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".adapter." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def lora_by_hand(x: torch.Tensor, wrapped) -> torch.Tensor:
    """``W x + b + alpha / dim * B A x`` of a LoRALinear at one process, from its weights."""
    base = wrapped.to_wrap
    out = x @ base.weight.t()
    if base.bias is not None:
        out = out + base.bias
    a, b = wrapped.adapter.linear_in.weight, wrapped.adapter.linear_out.weight
    return out + wrapped.adapter.alpha / wrapped.adapter.dim * (x @ a.t() @ b.t())
