"""Mixture of experts: the router, token dispatchers, experts and the MoE layer (megatron-core's
``megatron.core.transformer.moe``)."""
