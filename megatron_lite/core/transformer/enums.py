"""Enums of the transformer package, as upstream's ``megatron.core.transformer.enums``."""

from __future__ import annotations

import enum


class LayerType(enum.Enum):
    """What a slot of a pipeline layout holds: the embedding, the loss, an encoder or decoder layer,
    or a multi-token-prediction layer (upstream's values)."""

    embedding = 1
    loss = 2
    encoder = 3
    decoder = 4
    mtp = 5


class AttnMaskType(enum.Enum):
    """The attention mask a layer applies (upstream's values); megatron_lite's attention is causal."""

    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5
