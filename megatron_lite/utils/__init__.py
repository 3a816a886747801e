"""Helpers shared by every layer, importing nothing of megatron_lite (upstream: megatron.bridge.utils)."""
