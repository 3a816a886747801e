"""Distributed checkpoints in megatron-core's ``torch_dist`` format (``megatron.core.dist_checkpointing``):
every rank writes its pieces of named global tensors through ``torch.distributed.checkpoint`` (DCP's
``.metadata`` and ``__<rank>_<n>.distcp`` files) and any rank of any later layout reads the pieces it
needs, whoever wrote them. ``mapping`` says what a rank holds (megatron-core's ``ShardedTensor``,
``ShardedObject``, ``ShardedTensorFactory``), ``validation`` how a load checks it against the others,
``strategies.torch`` plans the reads and writes (and reads ``.metadata`` without running code),
``serialization`` saves and loads, ``strategies.async_utils`` writes from a background process."""

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_lite.core.dist_checkpointing.serialization import (
    check_data_files,
    load,
    load_metadata,
    missing_or_mismatched,
    plan_save,
    save,
)

__all__ = [
    "CheckpointingException",
    "ShardedObject",
    "ShardedTensor",
    "check_data_files",
    "load",
    "load_metadata",
    "missing_or_mismatched",
    "plan_save",
    "save",
]
