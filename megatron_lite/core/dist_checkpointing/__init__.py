"""Distributed checkpoints in megatron-core's ``torch_dist`` format (``megatron.core.dist_checkpointing``):
every rank writes its pieces of named global tensors through ``torch.distributed.checkpoint`` (DCP's
``.metadata`` and ``__<rank>_<n>.distcp`` files) and any rank of any later layout reads the pieces it
needs, whoever wrote them. ``mapping`` says what a rank holds (megatron-core's ``ShardedTensor``,
``ShardedObject``, ``ShardedTensorFactory``), ``validation`` how a load checks it against the others,
``strategies.planners`` plans the reads and writes, ``strategies.safe_reader`` reads ``.metadata``
without running code, ``pieces`` saves and loads lists of pieces (megatron_lite's own interface),
``serialization`` is megatron-core's ``save`` / ``load`` of nested state dicts over it, and
``strategies.async_utils`` / ``strategies.background_writer`` write from a background process."""

from megatron_lite.core.dist_checkpointing.core import CheckpointingException
from megatron_lite.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory
from megatron_lite.core.dist_checkpointing.serialization import (
    check_data_files,
    load,
    load_common_state_dict,
    load_content_metadata,
    load_metadata,
    load_pieces,
    load_plain_tensors,
    load_sharded_metadata,
    load_tensors_metadata,
    missing_or_mismatched,
    plan_save,
    save,
    save_pieces,
)

__all__ = [
    "CheckpointingException",
    "ShardedObject",
    "ShardedTensor",
    "ShardedTensorFactory",
    "check_data_files",
    "load",
    "load_common_state_dict",
    "load_content_metadata",
    "load_metadata",
    "load_pieces",
    "load_plain_tensors",
    "load_sharded_metadata",
    "load_tensors_metadata",
    "missing_or_mismatched",
    "plan_save",
    "save",
    "save_pieces",
]
