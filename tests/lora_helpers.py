"""What the LoRA tests share: tiny Llama- and Mixtral-shaped models, LoRA's flags, and a run of
pretrain.py's flags set up and trained for a few iterations inside a test's gloo world (one world
holds several runs, each at its own layout: the groups are torn down after each)."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Llama-shaped: rotary positions, RMSNorm, SwiGLU, 2 key/value groups for 4 heads, untied, no biases.
# A vocabulary padded to 128 at tp 1 and 2 alike, so every layout computes the same softmax.
LLAMA = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 64 --seq-length 16 --max-position-embeddings 16 --vocab-size 128 "
    "--make-vocab-size-divisible-by 64 --position-embedding-type rope --normalization RMSNorm --swiglu "
    "--disable-bias-linear --untie-embeddings-and-output-weights --micro-batch-size 2 --global-batch-size 8 "
    "--lr 1e-2 --min-lr 1e-3 --eval-iters 0 --seed 1234 --log-interval 1"
).split()

# Mixtral-shaped: the same with 4 experts, top-2, grouped GEMM (one adapter shared by a rank's experts).
MIXTRAL = [
    *LLAMA,
    *"--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-grouped-gemm".split(),
    *"--moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01".split(),
]

# GPT-2-shaped beside it: the output layer tied to the (frozen) word embeddings.
TIED = [f for f in LLAMA if f != "--untie-embeddings-and-output-weights"]

LORA = "--peft lora --lora-dim 4 --lora-alpha 8".split()


def train_run(argv: list[str], iters: int, save_at: dict | None = None):
    """On every rank of the caller's world: set up ``argv``'s run (``--nproc-per-node`` the world's
    size), train ``iters`` iterations and return ``(setup output, [lm loss per iteration])`` (the
    losses as tensors, from the last pipeline stage, on every rank). ``save_at``: ``{iteration:
    [(ckpt_format, directory), ...]}`` to save after that iteration. The model-parallel groups are
    destroyed on the way out, whatever happens, so the world can set up the next run."""
    from megatron_lite.core import parallel_state
    from megatron_lite.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator
    from megatron_lite.training import checkpointing
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.forward_step_func_types import prepare_forward_step_func
    from megatron_lite.training.gpt_step import forward_step
    from megatron_lite.training.setup import setup
    from megatron_lite.training.state import GlobalState
    from megatron_lite.training.training import train_step

    config = parse_args([*argv, "--nproc-per-node", str(dist.get_world_size())])
    state = GlobalState(config)
    try:
        s = setup(state)
        step = prepare_forward_step_func(forward_step, state)
        t, ts = config.train, state.train_state
        reconfigure_num_microbatches_calculator(
            dist.get_rank(), None, t.global_batch_size, t.micro_batch_size, config.data_parallel_size
        )
        losses = []
        for _ in range(iters):
            report, *_ = train_step(
                step, s.train_data_iterator, s.model, s.optimizer, s.scheduler, config, state.timers, s.pg_collection
            )  # fmt: skip
            ts.step += 1
            ts.consumed_train_samples += t.global_batch_size
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, report.get("lm loss"))
            losses.append(next(loss for loss in every if loss is not None))
            for ckpt_format, directory in (save_at or {}).get(ts.step, []):
                config.checkpoint.ckpt_format, config.checkpoint.save = ckpt_format, str(directory)
                checkpointing.save_checkpoint(state, s.model, s.optimizer, s.scheduler, s.pg_collection)
        return s, losses
    finally:
        dist.barrier()
        parallel_state.destroy_model_parallel()


def adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapters' weights of this rank's model chunks, by parameter name (copies)."""
    return {
        f"{c}.{n}": p.detach().clone()
        for c, chunk in enumerate(model)
        for n, p in chunk.named_parameters()
        if ".adapter." in n
    }
