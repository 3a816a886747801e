"""Megatron-layout checkpoints, written atomically and loaded with every rank agreeing.

Layout: ``DIR/iter_0000010/mp_rank_XX[_YYY]/model_optim_rng.pt`` per (tensor, pipeline) rank, written
by the rank that is 0 in its data x context parallel group (``_YYY`` only with pipeline parallelism,
as Megatron names them), ``iter_*/metadata.json`` with the parallel layout, and
``DIR/latest_checkpointed_iteration.txt``. ``layout`` names the files, ``save`` writes them, ``load``
reads them back through ``safety`` (no file can run code), ``compat`` and ``distrib_optim`` check
what a checkpoint holds against this run, ``rng`` carries the generators' state. A weights-only load
(``--finetune``, ``--pretrained-checkpoint``) of another layout goes through ``reshard``;
``checkpoint_args`` serves ``--use-checkpoint-args``. A PEFT run (``config.peft``) reads its base from
``--pretrained-checkpoint`` before the adapters are added (``pretrained``) and saves and resumes its
adapters only, naming their base (``peft``).

``--ckpt-format torch_dist`` (``torch_dist``) writes megatron-core's distributed checkpoint instead,
loadable at any layout, in the background with ``--async-save`` (``async_save``); ``commit`` makes
either format's directory appear atomically. A load detects the format from ``metadata.json``.
"""

from megatron_lite.training.checkpointing.async_save import (
    close_async_writer,
    finalize_async_save,
    start_async_writer,
)
from megatron_lite.training.checkpointing.layout import TRACKER, get_checkpoint_name, read_tracker
from megatron_lite.training.checkpointing.load import load_checkpoint
from megatron_lite.training.checkpointing.peft import check_resume as check_peft_resume
from megatron_lite.training.checkpointing.pretrained import load_pretrained_weights
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.save import save_checkpoint

__all__ = [
    "TRACKER",
    "CheckpointError",
    "check_peft_resume",
    "close_async_writer",
    "finalize_async_save",
    "get_checkpoint_name",
    "load_checkpoint",
    "load_pretrained_weights",
    "read_tracker",
    "start_async_writer",
    "save_checkpoint",
]
