"""A checkpoint of weights only, in Megatron's layout: what an import from Hugging Face writes
(iteration 0, the architecture recorded, no optimizer). ``--pretrained-checkpoint`` (or ``--finetune``)
loads it at any layout; ``--use-checkpoint-args`` takes the architecture from it."""

from __future__ import annotations

from megatron_lite.core import parallel_state
from megatron_lite.training.checkpointing.commit import write_checkpoint
from megatron_lite.training.checkpointing.safety import plain
from megatron_lite.training.checkpointing.save import shard_payload, write_shard


def save_model_weights(root: str, model, model_config, iteration: int = 0, flag: str = "--save") -> None:
    """Write this rank's weights as iteration ``iteration`` of ``root`` with ``model_config`` recorded
    as the checkpoint's ``config["model"]``, atomically as ``--save`` writes. Collective over the world."""

    def write_shards(tmp_root: str) -> None:
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
            write_shard(tmp_root, shard_payload(model, iteration, {"model": plain(model_config)}))

    write_checkpoint(root, iteration, write_shards, flag)
