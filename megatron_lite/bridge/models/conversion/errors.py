"""BridgeError: a Hugging Face model or directory the bridge cannot take; ``str(err)`` is one line."""


class BridgeError(ValueError):
    """One line naming the file or config field, and what megatron_lite can take instead."""
