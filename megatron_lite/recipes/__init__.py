"""Ready-made configuration pieces, Megatron-Bridge's ``megatron.bridge.recipes`` (its model-family
recipes are not here; ``utils`` holds the optimizer and schedule pairs they share)."""
