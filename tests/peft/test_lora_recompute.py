"""LoRA with full activation recompute: the adapters inside recomputed layers get the gradients they
get without recompute, although nothing before the layers trains (Megatron-Bridge's recompute fix)."""

from __future__ import annotations

import torch
from lora_case_helpers import randomize_adapters, tiny_gpt, tokens_and_positions

from megatron_lite.peft import LoRA


def _adapter_grads(**config) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = LoRA(dim=4)(tiny_gpt(**config))
    randomize_adapters(model)
    tokens, positions = tokens_and_positions()
    model(tokens, positions).float().mean().backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_full_recompute_gives_the_adapters_their_gradients():
    plain = _adapter_grads()
    recomputed = _adapter_grads(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    assert plain.keys() == recomputed.keys() and len(plain) == 16
    for name, grad in plain.items():
        assert recomputed[name] is not None, name
        torch.testing.assert_close(recomputed[name], grad, rtol=1e-5, atol=1e-7)


def test_the_decoder_input_is_left_alone_without_recompute():
    torch.manual_seed(0)
    model = LoRA(dim=4)(tiny_gpt())
    assert not model.decoder._forward_pre_hooks
