"""Build everything a run needs: groups, model, optimizer, scheduler, data, restored state."""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist

from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.core.optimizer import MegatronOptimizer, OptimizerParamScheduler
from megatron_lite.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.utils import get_collective_device
from megatron_lite.data.loaders import build_data_iterator, build_train_valid_datasets
from megatron_lite.training import checkpointing
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.initialize import initialize_megatron
from megatron_lite.training.memory.allocated import ALLOCATED_MEMORY
from megatron_lite.training.memory.attribution import MODEL_MEMORY, static_tensors
from megatron_lite.training.memory.report import OPTIMIZER_STATE_MEMORY
from megatron_lite.training.memory.saved_tensors import ACTIVATION_MEMORY
from megatron_lite.training.state import GlobalState
from megatron_lite.training.tokenizers import get_tokenizer


@dataclass
class SetupOutput:
    state: GlobalState
    model: list[DistributedDataParallel]
    """This rank's model chunks (one, or ``vp`` with virtual pipeline stages), as upstream."""
    optimizer: MegatronOptimizer
    scheduler: OptimizerParamScheduler
    train_data_iterator: object
    valid_data_iterator: object
    pg_collection: ProcessGroupCollection


def get_optimizer_param_scheduler(config: ConfigContainer, optimizer) -> OptimizerParamScheduler:
    """Megatron's schedule in samples: decay over lr_decay_iters (default train_iters) global batches."""
    s, gbs = config.scheduler, config.train.global_batch_size
    decay_steps = (s.lr_decay_iters or config.train.train_iters) * gbs
    warmup_steps = (
        int(s.lr_warmup_fraction * decay_steps)
        if s.lr_warmup_fraction is not None
        else s.lr_warmup_iters * gbs
    )
    if s.lr_decay_steps is not None:  # derived by ConfigContainer.validate (iterations or samples)
        decay_steps, warmup_steps = s.lr_decay_steps, int(s.lr_warmup_steps)
    if s.weight_decay_incr_style == "constant":  # one value: the end's, else --weight-decay
        start_wd = end_wd = (
            config.optimizer.weight_decay if s.end_weight_decay is None else s.end_weight_decay
        )
    else:
        start_wd, end_wd = s.start_weight_decay, s.end_weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=config.optimizer.lr,
        min_lr=config.optimizer.min_lr,
        lr_warmup_steps=min(warmup_steps, decay_steps),
        lr_decay_steps=decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=s.wd_incr_steps or config.train.train_iters * gbs,
        wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
    )


def build_data_iterators(
    config: ConfigContainer, state: GlobalState, pg_collection: ProcessGroupCollection, num_chunks: int = 1
):
    """Train and validation iterators positioned at the restored consumed-sample counts: one pair,
    or with ``num_chunks`` > 1 (virtual pipeline stages) one list of iterators per split, each over
    the same samples, so every chunk reads each microbatch once. Collective over the world."""
    t, v, ts = config.train, config.validation, state.train_state
    tokenizer = None if getattr(config.dataset, "mock", False) else get_tokenizer(config)
    train_ds, valid_ds = build_train_valid_datasets(config, pg_collection, tokenizer)
    if dist.get_rank() == 0 and config.tokenizer.tokenizer_type is not None:
        m = config.model
        padded = m.padded_vocab_size
        print(
            f" > padded vocab (size: {m.vocab_size}) with {padded - m.vocab_size} dummy tokens "
            f"(new size: {padded})",
            flush=True,
        )

    def iterators(dataset, consumed, micro_batch_size):
        its = [
            build_data_iterator(dataset, consumed, micro_batch_size, config, pg_collection.dp)
            for _ in range(num_chunks)
        ]
        return its[0] if num_chunks == 1 else (its if its[0] is not None else None)

    train = iterators(train_ds, ts.consumed_train_samples, t.micro_batch_size)
    if train is None and train_ds is not None and ts.step < t.train_iters:
        # A resumed run whose data is used up (another global batch size than the saving run's).
        raise checkpointing.CheckpointError(
            f"--train-iters {t.train_iters}: the checkpoint's run consumed {ts.consumed_train_samples} training "
            f"samples, all of the {len(train_ds)} this run draws; raise --train-iters"
        )
    valid = iterators(valid_ds, ts.consumed_valid_samples, v.eval_micro_batch_size or t.micro_batch_size)
    return train, valid


@contextlib.contextmanager
def _no_sync_all(model):
    with contextlib.ExitStack() as stack:
        for chunk in model:
            stack.enter_context(chunk.no_sync())
        yield


def build_model_and_optimizer(
    config: ConfigContainer,
    pg_collection: ProcessGroupCollection,
    *,
    foreach: bool | None = None,
    load_base=None,
):
    """This rank's model chunks, each wrapped in DDP, and their optimizer (the memory trackers told
    what they are). No collective: the preflight's dry run calls it under fake tensors and a fake
    process group, so that what it measures is this code (``foreach``: AdamW's, see MegatronOptimizer).

    With ``config.peft`` (Megatron-Bridge's pre-wrap hook): ``load_base(chunks)`` (setup's: the base
    weights from --pretrained-checkpoint, collective; None in the dry run) fills the bare chunks, the
    PEFT transform freezes them and adds the adapters, and only then DDP and the optimizer see them,
    so their buffers and state hold the trainable adapters only."""
    model_config = config.model
    model_config._pg_collection = pg_collection
    model_config.init_seed = config.rng.seed
    vp = model_config.virtual_pipeline_model_parallel_size
    modules = []
    for vp_stage in range(vp) if vp and vp > 1 else [None]:
        # This stage's part: first / last stage (and chunk) decided from the pp group and vp_stage.
        module = model_config.provide(vp_stage=vp_stage)
        # Weights are drawn on the CPU (layout-independent init), then live where the collectives run.
        device = get_collective_device()
        # Only when something is elsewhere: the dry run's fake parameters cannot be swapped for a copy.
        if any(t.device != device for t in itertools.chain(module.parameters(), module.buffers())):
            module.to(device)
        modules.append(module)
    if config.peft is not None:
        if load_base is not None:
            load_base(modules)
        modules = _apply_peft(config.peft, modules)
    model = []
    for module in modules:
        # Context-parallel ranks hold the same weights and see different tokens: average over both.
        model.append(
            DistributedDataParallel(
                model_config,
                module,
                dp_group=pg_collection.dp_cp,
                ddp_config=config.ddp,
                expt_dp_group=pg_collection.expt_dp,
            )
        )
        ACTIVATION_MEMORY.exclude_parameters(module.parameters())
    # The schedules call these: no_sync around all but the last microbatch, finalize after it.
    model_config.no_sync_func = partial(_no_sync_all, model)
    model_config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pg_collection)

    if config.optimizer.use_distributed_optimizer:
        optimizer = DistributedOptimizer(
            config.optimizer,
            model,
            model_parallel_group=pg_collection.mp,
            tp_group=pg_collection.tp,
            dp_group=pg_collection.dp_cp,
            foreach=foreach,
            expert_model_parallel_group=pg_collection.tp_ep_pp,
            expert_dp_group=pg_collection.expt_dp,
        )
    else:
        optimizer = MegatronOptimizer(
            config.optimizer,
            model,
            model_parallel_group=pg_collection.mp,
            tp_group=pg_collection.tp,
            foreach=foreach,
            expert_model_parallel_group=pg_collection.tp_ep_pp,
        )
    OPTIMIZER_STATE_MEMORY.track(optimizer)  # the memory report measures its state,
    MODEL_MEMORY.track(model)  # and the chunks' weights and gradient buffers
    # What the allocated-bytes tracker counts as static when it splits its peak into parts.
    ALLOCATED_MEMORY.track_static(partial(static_tensors, model, optimizer))
    return model, optimizer


def _apply_peft(peft, modules: list) -> list:
    """The PEFT transform over the bare model chunks (base frozen, adapters added), as Bridge's
    ``_apply_peft_transformation``."""
    modules = peft(modules, training=True)
    modules = modules if isinstance(modules, list) else [modules]
    peft.set_params_to_save(modules)  # what its adapter_key_filter keeps in a checkpoint, as Bridge
    return modules


def _print_peft_statistics(model) -> None:
    """Bridge's "PEFT Statistics" lines, for this rank's chunks (rank 0 prints)."""
    params = [p for chunk in model for p in chunk.parameters()]
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if dist.get_rank() == 0:
        print(
            f" PEFT statistics (rank 0): total parameters {total:,}, trainable parameters {trainable:,} "
            f"({100 * trainable / max(total, 1):.2f}%)",
            flush=True,
        )


def setup(state: GlobalState) -> SetupOutput:
    """Collective over the world (group creation, checkpoint load)."""
    config = state.cfg
    pg_collection = initialize_megatron(config)
    if config.checkpoint.load:
        # A PEFT checkpoint resumes a PEFT run on its base, a full one a full run: else one line,
        # before any weights are read.
        checkpointing.check_peft_resume(config)
    load_base = None
    if config.peft is not None:
        load_base = partial(checkpointing.load_pretrained_weights, state)
    model, optimizer = build_model_and_optimizer(config, pg_collection, load_base=load_base)
    scheduler = get_optimizer_param_scheduler(config, optimizer)
    if config.peft is not None:
        _print_peft_statistics(model)
    # A PEFT run resumes its adapters from --load (its base is in already).
    if config.checkpoint.load or (config.checkpoint.pretrained_checkpoint and config.peft is None):
        checkpointing.load_checkpoint(state, model, optimizer, scheduler, pg_collection)
    state.start_loggers()  # after loading: TensorBoard purges steps past the resumed iteration
    train_iter, valid_iter = build_data_iterators(config, state, pg_collection, num_chunks=len(model))
    return SetupOutput(state, model, optimizer, scheduler, train_iter, valid_iter, pg_collection)
