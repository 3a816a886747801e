"""Training: config, arguments, state, loop, checkpointing."""
