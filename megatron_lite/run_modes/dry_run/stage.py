"""One stage's dry run, in a process of its own: a fake world, the fake batch, the real code."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.distributed as dist

from megatron_lite.training.utils.packed_seq_utils import batches_carry_boundaries


def _fake_batches(config, device):
    """The data loader's microbatches as fake tensors, made when read (under the tracker, as a real
    loader's are): one iterator, or one per model chunk with virtual pipeline stages."""
    b, s = config.train.micro_batch_size, config.model.seq_length
    mask = getattr(config.dataset, "create_attention_mask", False) and config.dataset.blend is not None
    packed = batches_carry_boundaries(config)

    def batches():
        while True:
            batch = {
                "tokens": torch.zeros(b, s, dtype=torch.long, device=device),
                "labels": torch.zeros(b, s, dtype=torch.long, device=device),
                "loss_mask": torch.ones(b, s, dtype=torch.float32, device=device),
                "position_ids": torch.zeros(b, s, dtype=torch.long, device=device),
            }
            if mask:
                batch["attention_mask"] = torch.zeros(b, 1, s, s, dtype=torch.bool, device=device)
            if packed:
                batch.update(_fake_boundaries(b, s, getattr(config.dataset, "pad_seq_to_mult", None) or 1))
            yield batch

    vp = config.model.virtual_pipeline_model_parallel_size or 1
    return batches() if vp == 1 else [batches() for _ in range(vp)]


def _fake_boundaries(b: int, s: int, multiple: int) -> dict:
    """An SFT sample's boundaries (the loader's keys, dtypes and shapes) for the costliest pack: one
    example as long as the row allows, the most attention a row can hold (sum of s_i^2), and a pad tail
    of ``multiple`` positions (each example a multiple of it under CP / SP: the dataset's
    pad_seq_to_mult), so every per-example op runs. Real tensors, host metadata as the loader's: the
    model reads them on the host (a fake tensor has no values)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        cu_seqlens = torch.full((b, s + 2), -1, dtype=torch.int32)
        cu_seqlens[:, :3] = torch.tensor([0, s - multiple, s], dtype=torch.int32)
        return {
            "cu_seqlens": cu_seqlens,
            "cu_seqlens_argmin": torch.full((b,), 3, dtype=torch.long),
            "max_seqlen": torch.full((b,), s - multiple, dtype=torch.int32),
        }


@contextlib.contextmanager
def _fake_world(config, rank: int):
    """This process as global rank ``rank`` of a fake world of the job's size, its groups and seeds
    made by the workers' own ``initialize_megatron``."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    from megatron_lite.core import parallel_state
    from megatron_lite.training.initialize import initialize_megatron

    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=config.world_size)
    try:
        yield initialize_megatron(config)  # joins the world already there, as under torchrun
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def stage_ranks(config) -> list[int]:
    """The global ranks of the pipeline stages at TP / CP / DP rank 0: the pipeline group of rank 0,
    as initialize_megatron's groups (Megatron core's default order) make it. Arithmetic, no world."""
    from megatron_lite.core.parallel_state import DEFAULT_ORDER, RankGenerator

    m = config.model
    generator = RankGenerator(
        tp=m.tensor_model_parallel_size, ep=1, dp=config.data_parallel_size,
        pp=m.pipeline_model_parallel_size, cp=m.context_parallel_size, order=DEFAULT_ORDER,
    )  # fmt: skip
    return generator.get_ranks("pp")[0]


def measure_stage(config, rank: int, device_type: str = "cpu", routing: str | None = None) -> tuple[int, int]:
    """(allocated peak, static bytes at it) of global rank ``rank``: the optimizer's first step (its
    state allocated, on zero gradients) and then one training step with the state resident, as a
    real run's second; on fake tensors in a fake world. Run it in a process of its own (it sets up
    groups and seeds), and one stage a process: a built model is not freed by the garbage collector
    (its C++ autograd hooks hold it), and the tracker would count it in the next stage's run. A MoE
    model's layers route as ``routing`` ("balanced" or "worst", dry_run/moe.py) plans; None: dense."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_lite.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
    from megatron_lite.core.transformer.dot_product_attention import cuda_attention_kernels
    from megatron_lite.core.utils import fake_world_stands_for
    from megatron_lite.run_modes.dry_run.moe import moe_dry_run
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY
    from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY
    from megatron_lite.training.setup import build_model_and_optimizer, get_optimizer_param_scheduler
    from megatron_lite.training.state import GlobalState
    from megatron_lite.training.training import train_step

    state = GlobalState()
    state.cfg = config
    ALLOCATED_MEMORY.reset(storage_device="meta")
    ACTIVATION_MEMORY.reset()  # nothing the parent counted or excluded (a forked child inherits it)
    stands_for = fake_world_stands_for("nccl" if device_type == "cuda" else "gloo")
    with (
        stands_for,
        _fake_world(config, rank) as pg,
        FakeTensorMode(allow_non_fake_inputs=True),
        moe_dry_run(config, routing),
        cuda_attention_kernels() if device_type == "cuda" else contextlib.nullcontext(),
    ):
        t = config.train
        reconfigure_num_microbatches_calculator(rank, None, t.global_batch_size, t.micro_batch_size,
                                                config.data_parallel_size)  # fmt: skip
        # A GPU job's AdamW is PyTorch's foreach one (its CUDA default); the CPU's is the per-tensor loop.
        model, optimizer = build_model_and_optimizer(
            config, pg, foreach=True if device_type == "cuda" else None
        )
        with ALLOCATED_MEMORY.track():
            optimizer.step()
        data = _fake_batches(config, next(model[0].parameters()).device)
        scheduler = get_optimizer_param_scheduler(config, optimizer)
        train_step(partial(forward_step, state), data, model, optimizer, scheduler, config, state.timers, pg,
                   track_activation_memory=True)  # fmt: skip
    return ALLOCATED_MEMORY.peak_bytes, ALLOCATED_MEMORY.peak_static_bytes
