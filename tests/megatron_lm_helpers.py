"""Megatron-LM's side of the tests that read its checkpoints and write ones it reads: its saved command
line (``args`` under its own names, with the megatron-core objects it pickles into it), its schedule
and RNG states, megatron-core's models (and a torch-format state dict under Transformer Engine's
names); and our resume of a checkpoint in a rank, to compare with."""

from __future__ import annotations

import argparse
import pathlib
import random
import signal
from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist
from mcore_helpers import SMALL_LLAMA, randomize

VOCAB, SEQ = 256, 16

MOE = dict(
    num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_token_dispatcher_type="allgather"
)
# Transformer Engine's names for the fused norms, in a torch-format state dict.
TE_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight"}
TE_NORMS["pre_mlp_layernorm.weight"] = "mlp.linear_fc1.layer_norm_weight"


def megatron_lm_args(**parallel) -> argparse.Namespace:
    """Megatron-LM's saved command line for SMALL_LLAMA (its own argument names), with what else it
    pickles into it: megatron-core enums, a path, a signal."""
    from megatron.core.enums import ModelType
    from megatron.core.rerun_state_machine import RerunMode
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=8, group_query_attention=True,
        num_query_groups=4, kv_channels=8, normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True,
        position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=True, vocab_size=VOCAB, padded_vocab_size=VOCAB,
        make_vocab_size_divisible_by=128, max_position_embeddings=SEQ, seq_length=SEQ, hidden_dropout=0.0,
        attention_dropout=0.0, pipeline_model_parallel_size=1, data_parallel_size=1, consumed_train_samples=112,
        model_type=ModelType.encoder_or_decoder, attention_backend=AttnBackend.auto,
        rerun_mode=RerunMode.VALIDATE_RESULTS, save=pathlib.PosixPath("/checkpoints/llama"),
        exit_signal=signal.SIGTERM, **parallel,
    )  # fmt: skip


def megatron_lm_rng_state() -> list[dict]:
    return [
        {
            "random_rng_state": random.getstate(),
            "np_rng_state": np.random.get_state(),
            "torch_rng_state": torch.get_rng_state(),
            "rng_tracker_states": {},
        }
    ]


def track_latest(root: str, iteration: int) -> None:
    """Megatron-LM's tracker file naming ``iteration`` (rank 0 writes it), then every rank waits for it."""
    if dist.get_rank() == 0:
        with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
            f.write(str(iteration))
    dist.barrier()


def megatron_lm_schedule() -> dict:
    return dict(max_lr=3e-4, lr_warmup_steps=16, num_steps=112, lr_decay_style="cosine", lr_decay_steps=800)


def mcore_llama():
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    mps.destroy_model_parallel()
    mps.initialize_model_parallel(tensor_model_parallel_size=2)
    config = TransformerConfig(**SMALL_LLAMA, tensor_model_parallel_size=2, use_cpu_initialization=True)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    model = GPTModel(
        config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=False, position_embedding_type="rope"
    )
    randomize(model, lambda _, p: getattr(p, "tensor_model_parallel", False), dist.get_rank())
    return model


def mcore_mixtral():
    from megatron.core import parallel_state as mps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    mps.destroy_model_parallel()
    mps.initialize_model_parallel(expert_model_parallel_size=2)
    config = TransformerConfig(
        **SMALL_LLAMA, **MOE, expert_model_parallel_size=2, use_cpu_initialization=True
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    for (
        layer_spec
    ) in spec.layer_specs:  # a MoE layer keeps Transformer Engine's norm name (see the MoE interchange test)
        layer_spec.submodules.sharded_state_dict_keys_map.pop("pre_mlp_layernorm.", None)
    model = GPTModel(
        config, spec, VOCAB, SEQ, share_embeddings_and_output_weights=False, position_embedding_type="rope"
    )
    randomize(model, lambda name, _: ".local_experts." in name, dist.get_rank())
    return model


# SMALL_LLAMA (mcore_llama) as our flags.
LLAMA_FLAGS = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 96 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 4 --kv-channels 8 --normalization RMSNorm --norm-epsilon 1e-6 --swiglu "
    "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
    "--vocab-size 256 --max-position-embeddings 16 --hidden-dropout 0 --attention-dropout 0 "
    "--tensor-model-parallel-size 2"
).split()


TRAIN = "--micro-batch-size 1 --global-batch-size 2 --seq-length 16 --train-iters 1 --lr 0 --min-lr 0".split()
TRAIN += ["--use-checkpoint-args", "--log-interval", "1"]
FINETUNE = [*TRAIN, "--ckpt-format", "torch_dist", "--save-interval", "1"]


def our_resume(argv):
    """megatron_lite's setup resuming ``argv``'s checkpoint on this rank: (its output, parameter name ->
    (exp_avg, exp_avg_sq, step) of our optimizer)."""
    from megatron_lite.training.arguments import parse_args
    from megatron_lite.training.setup import setup
    from megatron_lite.training.state import GlobalState

    s = setup(GlobalState(parse_args(argv)))
    names = {id(p): n.removeprefix("module.") for n, p in s.model[0].named_parameters()}
    states = {names[id(u.param)]: s.optimizer.optimizer.state[u.main] for u in s.optimizer.units}
    return s, {n: (st["exp_avg"], st["exp_avg_sq"], float(st["step"])) for n, st in states.items()}


def te_state_dict(model) -> dict:
    """The model's state dict as Megatron-LM's Transformer Engine layers name it."""
    state = {}
    for key, value in model.state_dict().items():
        for local, te in TE_NORMS.items():
            key = key.replace(local, te)
        state[key] = value
        if key.endswith("linear_qkv.weight"):
            state[key.replace(".weight", "._extra_state")] = None  # TE's FP8 metadata (none without FP8)
    return state


def fp32_optimizer(adam):
    """megatron-core's FP32Optimizer around ``adam``, without its constructor (which makes a CUDA tensor
    for the loss scale that the sharded state does not use)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    def init_state_fn(opt, config=None):  # megatron-core's, for Adam
        for group in opt.param_groups:
            for p in group["params"]:
                if not opt.state[p]:
                    opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"] = (
                        torch.zeros_like(p),
                        torch.zeros_like(p),
                    )

    optimizer = object.__new__(FP32Optimizer)
    optimizer.optimizer, optimizer.config, optimizer.init_state_fn = adam, None, init_state_fn
    return optimizer


def fully_reshardable(model, state_of) -> dict:
    """The distributed optimizer's sharded state as megatron-core's ``DistributedOptimizer`` lays it
    out in Megatron-LM's ``fully_reshardable`` form (``sharded_param_state_fully_reshardable``; that
    class itself needs CUDA): per parameter, its model ShardedTensor under ``optimizer.state.param.``,
    ``.exp_avg.`` and ``.exp_avg_sq.``, ``state_of(param)`` giving the three tensors; the common part
    its ``state_dict``: torch's param groups without parameters, the step in each."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    params = dict(model.named_parameters())
    param_state = {}
    for index, (name, sh) in enumerate(
        (n, sh) for n, sh in model.sharded_state_dict().items() if n in params
    ):
        param_state[index] = {}
        for k, t in state_of(params[name]).items():
            # as megatron-core: a factory (the SwiGLU weight's two halves) takes no dtype
            dtype = {} if isinstance(sh, ShardedTensorFactory) else {"dtype": t.dtype}
            param_state[index][k] = replace(sh, key=f"optimizer.state.{k}.{sh.key}", data=t, **dtype)
    return {"param_state": param_state, "param_state_sharding_type": "fully_reshardable"}
