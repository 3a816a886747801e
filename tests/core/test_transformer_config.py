"""TransformerConfig's derived initialisers: normal(0, init_method_std), the output projections' scaled
by 1 / sqrt(2 num_layers), following later changes of either field; and a config equals itself (as
upstream's does: the bridge's mappings find a module's config by comparing it)."""

from __future__ import annotations

import copy

from megatron_lite.core.transformer.transformer_config import TransformerConfig


def _config() -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2)


def test_a_config_equals_itself_and_its_copy_keeps_the_values():
    config = _config()
    assert config == config and config.init_method is config.init_method
    assert copy.deepcopy(config).init_method.keywords == config.init_method.keywords


def test_the_derived_initialisers_follow_later_changes():
    config = _config()
    config.init_method_std, config.num_layers = 0.5, 8
    assert config.init_method.keywords == {"sigma": 0.5}
    assert config.output_layer_init_method.keywords == {"sigma": 0.5 / 4}  # sqrt(2 x 8)


def test_an_explicit_initialiser_is_kept():
    explicit = _config().init_method
    assert (
        TransformerConfig(
            num_layers=2, hidden_size=8, num_attention_heads=2, init_method=explicit
        ).init_method
        is explicit
    )
