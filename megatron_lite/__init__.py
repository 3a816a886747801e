"""megatron_lite: a compact Megatron-style training framework."""
