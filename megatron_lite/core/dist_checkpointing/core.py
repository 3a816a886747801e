"""What every checkpointing module shares (megatron-core's ``dist_checkpointing.core``): its exception."""


class CheckpointingException(Exception):
    """A checkpoint that cannot be saved or does not hold what a load asks for (megatron-core's name)."""
