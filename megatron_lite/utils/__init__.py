"""Helpers shared by the training and model packages (upstream: megatron.bridge.utils)."""
