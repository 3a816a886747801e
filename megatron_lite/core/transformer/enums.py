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
