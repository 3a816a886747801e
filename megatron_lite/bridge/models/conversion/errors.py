"""BridgeError: a Hugging Face model or directory the bridge cannot take; ``str(err)`` is one line."""


class BridgeError(ValueError):
    """One line naming the file or config field, and what megatron_lite can take instead."""


def raise_rank0_error(error: str | None) -> None:
    """Raise rank 0's error line (None: none) as a BridgeError on every rank, so that a write only rank
    0 does fails the whole world alike. Collective over the world when it is initialized."""
    import torch.distributed as dist

    if dist.is_initialized():
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise BridgeError(error)
