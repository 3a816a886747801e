"""``--ckpt-format torch_dist``: megatron-core's distributed checkpoint, loadable at any layout.

``iter_0000010/`` holds DCP's ``.metadata`` and ``__<rank>_0.distcp`` files (every tensor once, by
its global name, shape and each piece's offsets: ``core.models.gpt.sharded_state_dict`` for the
weights, ``core.optimizer.sharded_state`` for the optimizer in model space), ``common.pt`` (rank 0:
iteration, config, layout, scheduler, train state, the optimizer's step and hyper-parameters, every
rank's RNG state; and what Megatron-LM's load reads besides, ``megatron_lm_out``) and megatron-core's
``metadata.json`` (``sharded_backend: torch_dist``). It is
written into a temporary directory and committed like the legacy format (``commit``); with
``--async-save`` the tensors are written in the background (``async_save``).

A load reads, on every rank, just the pieces of its own parameters and optimizer shards for this
run's tp / pp / vp / dp and distributed-optimizer setting, whatever the saving run's were. RNG
streams carry over only to the same layout; otherwise the generators are reseeded, said in one line.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_lite.core.dist_checkpointing import (
    CheckpointingException,
    check_data_files,
    load_metadata,
    load_pieces,
    missing_or_mismatched,
    plan_save,
)
from megatron_lite.core.optimizer.sharded_state import (
    FP32_PARAM,
    common_state,
    load_common_state,
)
from megatron_lite.training.checkpointing import megatron_lm
from megatron_lite.training.checkpointing.agreement import agree
from megatron_lite.training.checkpointing.async_save import async_writer, finalize_async_save, finish_save
from megatron_lite.training.checkpointing.commit import begin_checkpoint, end_checkpoint, save_error
from megatron_lite.training.checkpointing.compat import resharded_model_error, saved_split
from megatron_lite.training.checkpointing.layout import CHECKPOINT_VERSION, COMMON, model_chunks, read_common
from megatron_lite.training.checkpointing.megatron_lm_optimizer import chained_keys
from megatron_lite.training.checkpointing.megatron_lm_out import (
    chained_parts,
    content_metadata,
    megatron_lm_args,
    megatron_lm_optimizer,
)
from megatron_lite.training.checkpointing.peft import checkpoint_config, peft_entries, saved_parameters
from megatron_lite.training.checkpointing.reshard import describe_layout
from megatron_lite.training.checkpointing.rng import rng_state, set_rng_state
from megatron_lite.training.checkpointing.safety import CheckpointError
from megatron_lite.training.checkpointing.sharded_pieces import fp32_mains, layout_record, sharded_pieces
from megatron_lite.training.initialize import seed_rank_generators
from megatron_lite.utils.atomic_io import atomic_write_bytes

SHARDED_BACKEND = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def _common(state, model, optimizer, scheduler, rngs: list) -> dict:
    prefix, distributed, saved = fp32_mains(model, optimizer)
    layout = layout_record(state.cfg.model)
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": state.train_state.step,
        "config": checkpoint_config(state.cfg),
        "parallel_layout": layout,
        "train_state": state.train_state.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "optimizer": megatron_lm_optimizer(
            {
                **common_state(optimizer),
                "use_distributed_optimizer": distributed,
                "fp32_param": saved,
                "fp32_param_prefix": prefix,
            },
            state.cfg.optimizer.lr,
            state.cfg.optimizer.min_lr,
            fp32_weights=all(p.dtype == torch.float32 for c in model_chunks(model) for p in c.parameters()),
            parts=chained_parts(n_p for c in model_chunks(model) for n_p in c.named_parameters()),
        ),
        "rng_state": rngs,
        # What Megatron-LM's load_checkpoint reads besides (megatron_lm_out.py).
        "args": megatron_lm_args(
            state.cfg, state.train_state, dist.get_world_size(), layout["data_parallel_size"]
        ),
        "num_floating_point_operations_so_far": float(state.train_state.floating_point_operations_so_far),
        "content_metadata": content_metadata(distributed),
        **peft_entries(state.cfg),  # a PEFT run's adapters name their base (peft.py)
    }


def save_distributed(state, model, optimizer, scheduler) -> None:
    """Save this iteration in ``torch_dist``; with ``--async-save`` only schedule the write (the
    previous one first finished). Collective over the world."""
    cfg = state.cfg.checkpoint
    root, iteration = cfg.save, state.train_state.step
    finalize_async_save(blocking=True)
    for chunk in model_chunks(model):  # the distributed optimizer's parameter all-gather, if in flight
        if hasattr(chunk, "finish_param_sync"):
            chunk.finish_param_sync()
    if dist.get_rank() == 0:
        print(f" saving checkpoint at iteration {iteration:7d} to {root} in torch_dist format", flush=True)
    tmp_root = begin_checkpoint(root, iteration)
    rngs = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rng_state(), rngs, dst=0)  # every rank's generators, in common.pt
    error, pieces, request = None, None, None
    try:
        if dist.get_rank() == 0:
            common = _common(state, model, optimizer, scheduler, rngs)
            atomic_write_bytes(os.path.join(tmp_root, COMMON), lambda f: torch.save(common, f))
        prefix, every, _ = fp32_mains(model, optimizer)
        pieces = sharded_pieces(
            model,
            optimizer,
            state.cfg.model,
            with_optimizer=True,
            fp32_from=prefix,
            every_fp32=every,
            only=saved_parameters(state.cfg, model),
        )
    except Exception as err:
        error = save_error("--save", root, iteration, err)
    agree(error, cleanup=tmp_root)
    try:
        request = plan_save(pieces, tmp_root)
    except CheckpointingException as err:
        error = f"--save {root}: iteration {iteration} not saved, {err}"
    agree(error, cleanup=tmp_root)
    commit = (root, iteration, tmp_root)
    if cfg.async_save:
        try:
            async_writer().schedule(request, commit, SHARDED_BACKEND)
        except Exception as err:  # shared memory full, the writer not starting: on every rank
            error = save_error("--save", root, iteration, err)
        agree(error, cleanup=tmp_root)
        return
    results = []
    try:
        results = request.write()
    except Exception as err:  # a full disk: every rank hears of it, the partial save goes
        error = save_error("--save", root, iteration, err)
    agree(error, cleanup=tmp_root)
    end_checkpoint(
        root, iteration, tmp_root, finish_save(request, results, root, iteration), metadata=SHARDED_BACKEND
    )
    if dist.get_rank() == 0:
        print(f" successfully saved checkpoint from iteration {iteration:7d} to {root}", flush=True)


def _unreadable(flag: str, root: str, iteration: int, err: Exception) -> str:
    return f"{flag} {root}: iteration {iteration} cannot be read ({type(err).__name__}: {err})".splitlines()[
        0
    ]


def _iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _fit_error(pieces, metadata, root: str, iteration: int, flag: str = "--load") -> str | None:
    """One line naming what the checkpoint (its DCP ``metadata``) lacks for ``pieces``; None when it
    holds them all."""
    problems = missing_or_mismatched(pieces, metadata)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"{flag} {root}: iteration {iteration} does not fit this model: {problems[0]}{more}"


def read_pieces(pieces, metadata, root: str, iteration: int, flag: str = "--load") -> None:
    """Read ``pieces`` in place from iteration ``iteration`` of ``root`` (whose ``metadata`` the
    caller read). Collective over the world; a failure on any rank is one CheckpointError on all."""
    error = None
    for piece in pieces:
        if piece.allow_shape_mismatch:
            piece.data.zero_()  # padding rows the checkpoint does not cover start at zero
    try:
        with torch.no_grad():
            load_pieces(pieces, _iteration_dir(root, iteration), metadata)
    except Exception as err:
        error = _unreadable(flag, root, iteration, err)
    agree(error)


def load_distributed_weights(
    model, model_cfg, root: str, iteration: int, flag: str = "--load", only: set | None = None
) -> None:
    """Only the weights of iteration ``iteration`` of the ``torch_dist`` checkpoint ``root``, at this
    world's layout (a Hugging Face export, a conversion); ``only``: these parameters alone (a PEFT
    checkpoint's adapters). Collective over the world."""
    error, metadata = None, None
    pieces = sharded_pieces(model, None, model_cfg, with_optimizer=False, only=only)
    try:
        metadata = load_metadata(_iteration_dir(root, iteration))
        check_data_files(_iteration_dir(root, iteration), metadata)
        error = _fit_error(pieces, metadata, root, iteration, flag)
    except Exception as err:
        error = _unreadable(flag, root, iteration, err)
    agree(error)
    read_pieces(pieces, metadata, root, iteration, flag)


def load_distributed(state, model, optimizer, scheduler, root: str, iteration: int, finetune: bool) -> None:
    """Restore iteration ``iteration`` of the ``torch_dist`` checkpoint ``root`` at this run's layout
    (weights only with ``finetune``). Collective over the world."""
    cfg, model_cfg = state.cfg.checkpoint, state.cfg.model
    with_optimizer = cfg.load_optim and not finetune
    # Without the optimizer's state: the fp32 main parameters from the checkpoint's fp32 values.
    mains_only = not with_optimizer and cfg.load_main_params_from_ckpt
    error, common, pieces, metadata = None, None, [], None
    try:
        common = read_common(root, iteration)
        error = resharded_model_error(root, common["config"], model_cfg)
        if error is None and with_optimizer and common.get("megatron_lm"):  # Megatron-LM's optimizer state
            error = megatron_lm.optimizer_error(f"--load {root}", common["megatron_lm"]["optimizer_error"])
        if error is None and with_optimizer:
            mismatch = scheduler.checkpoint_mismatch(common["opt_param_scheduler"])
            error = mismatch and f"--load {root}: iteration {iteration}: {mismatch}"
        saved, now = common["parallel_layout"], layout_record(model_cfg)
        saved_tp, train_state = saved["tensor_model_parallel_size"], common["train_state"]
        rngs, fp32_saved = common["rng_state"], bool(common["optimizer"]["fp32_param"])
        # Megatron-LM's fully_reshardable distributed optimizer names them otherwise.
        fp32 = common["optimizer"].get("fp32_param_prefix", FP32_PARAM) if fp32_saved else ""
        if error is None:
            pieces = sharded_pieces(
                model,
                optimizer,
                model_cfg,
                with_optimizer=with_optimizer or mains_only,
                fp32_from=fp32,
                moments=not mains_only,
                # An fp32 model takes its weights from the fp32 main parameters saved beside bf16 ones.
                fp32_weights_from=fp32 if with_optimizer else "",
                only=saved_parameters(state.cfg, model),
            )
            metadata = load_metadata(_iteration_dir(root, iteration))
            check_data_files(_iteration_dir(root, iteration), metadata)  # a missing or cut .distcp
            if common.get("megatron_lm"):
                chained_keys(pieces, metadata.state_dict_metadata)
            error = _fit_error(pieces, metadata, root, iteration)
    except CheckpointError as err:
        error = str(err)
    except Exception as err:  # an unreadable .metadata, a common.pt of an unexpected shape
        error = _unreadable("--load", root, iteration, err)
    agree(error)
    if dist.get_rank() == 0 and saved != now:
        before = describe_layout(saved_tp, saved_split(common["config"]))
        after = describe_layout(model_cfg.tensor_model_parallel_size, model_cfg)
        experts = any("expert_model_parallel_size" in layout for layout in (saved, now))
        print(
            f" resharding checkpoint from {before} dp={saved['data_parallel_size']}{_experts(saved, experts)} to "
            f"{after} dp={now['data_parallel_size']}{_experts(now, experts)}",
            flush=True,
        )
    read_pieces(pieces, metadata, root, iteration)
    if not finetune:
        state.train_state.load_state_dict(train_state)
        if with_optimizer:
            load_common_state(optimizer, common["optimizer"])
            scheduler.load_state_dict(common["opt_param_scheduler"])
        if cfg.load_rng:
            _restore_rng(rngs, saved == now, state.cfg.rng.seed + iteration)
    if not with_optimizer and not mains_only:
        optimizer.reload_model_params(None)  # fp32 main parameters from the weights just read
    if finetune:
        scheduler.step(0)


def _experts(layout: dict, shown: bool) -> str:
    """`` ep=2 etp=1`` where either layout records expert sizes (one that does not: ep 1, expert TP
    its TP)."""
    if not shown:
        return ""
    ep = layout.get("expert_model_parallel_size", 1)
    return f" ep={ep} etp={layout.get('expert_tensor_parallel_size', layout['tensor_model_parallel_size'])}"


def _restore_rng(rngs: list | None, same_layout: bool, seed: int) -> None:
    if rngs is not None and same_layout:
        set_rng_state(rngs[dist.get_rank()])
        return
    why = "per rank and do not carry to another layout" if rngs is not None else MEGATRON_LM_RNG
    reseed(why, seed)


MEGATRON_LM_RNG = (
    "Megatron-LM's (its CUDA generators' and per tensor-parallel rank), which megatron_lite does not carry"
)


def reseed(why: str, seed: int) -> None:
    """Seed every generator from ``seed`` (--seed + iteration), saying why the checkpoint's states are not used."""
    if dist.get_rank() == 0:
        print(f" random generator states are {why}; reseeding from --seed + iteration ({seed})", flush=True)
    seed_rank_generators(seed)
