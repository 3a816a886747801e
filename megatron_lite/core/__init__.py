"""Megatron core equivalents: parallel state, tensor/pipeline/data parallelism, models, optimizer."""
