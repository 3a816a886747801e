"""Whole training steps for bench/pipeline_vs_torch_pipelining.py's speed sections.

A contender is one global batch through forward-backward, the global grad-norm clip and AdamW: ours
through megatron_lite's own ``train_step`` (DDP grad buffers, the schedule, finalize_model_grads,
MegatronOptimizer, the activation tracker users pay), the peer through ``Schedule1F1B.step`` and the
clip and ``torch.optim.AdamW`` step a torch.distributed.pipelining user writes (same hyper-parameters;
no tracker). Every contender runs on a prefix of one world's ranks (its own pipeline group, built
here): the others wait in a barrier, which takes no CPU (gloo blocks). Sharing processes, every
contender runs with glibc's default malloc settings, as a torch.distributed.pipelining user's would:
pretrain.py's workers keep freed host memory instead (training/memory/host_allocator.py), which
bench/pipeline_stage_breakdown.py's page-fault and kernel columns show. Ours sends activations and
gradients between its stages through shared memory (core/pipeline_parallel/shared_memory_p2p.py, as
pretrain.py's workers do on one host), the peer through gloo's sockets; ``ours(..., sockets=True)``
runs ours over a pipeline group kept on gloo's sockets, to show what the transport alone is worth.
Building the groups is collective over the world.
"""

from __future__ import annotations

import math
import os
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset
from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron_lite.core.optimizer import MegatronOptimizer
from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig
from megatron_lite.core.pipeline_parallel import shared_memory_p2p
from megatron_lite.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron_lite.core.process_groups_config import ProcessGroupCollection
from megatron_lite.core.tensor_parallel import vocab_parallel_cross_entropy
from megatron_lite.training.config import ConfigContainer
from megatron_lite.training.gpt_step import forward_step
from megatron_lite.training.setup import _no_sync_all, get_optimizer_param_scheduler
from megatron_lite.training.state import GlobalState
from megatron_lite.training.training import train_step
from megatron_lite.utils.cpu_features import BF16_MATRIX_FLAGS, cpu_flags


class TorchPipelineStage(nn.Module):
    """A GPTModel stage with the plain tensor-in / tensor-out forward torch.distributed.pipelining wants."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x):
        g = self.gpt
        hidden = g.embedding(x, torch.arange(x.shape[1]).expand_as(x)) if g.pre_process else x
        hidden = g.decoder(hidden)
        return g.output_layer(hidden)[0] if g.post_process else hidden


def peer_loss(logits, labels):
    """The peer's loss: the mean token cross-entropy, through the same kernel as ours."""
    return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).mean()


def mock_batches(n: int, cfg, mbs: int) -> list[dict]:
    """``n`` microbatches of ``mbs`` MockGPTDataset samples for ``cfg``'s vocabulary and sequence."""
    data = MockGPTDataset(
        vocab_size=cfg.vocab_size, sequence_length=cfg.seq_length, seed=1, num_samples=n * mbs
    )
    return [{k: torch.stack([data[i * mbs + j][k] for j in range(mbs)]) for k in data[0]} for i in range(n)]


def threads_for(pp: int) -> int:
    """Intra-op threads per process when ``pp`` processes share this machine's cores (launcher's rule)."""
    return max(1, (os.cpu_count() or 1) // pp)


class Groups:
    """Per pipeline size, the group of ranks 0..pp-1 and this rank's singleton group; and for
    ``sockets``, a second group of ranks 0..sockets-1 whose p2p stays on gloo's sockets. Collective
    over the world: every rank creates every group, in the same order."""

    def __init__(self, world: int, sizes, sockets: int | None = None):
        rank = dist.get_rank()
        singles = [dist.new_group([r]) for r in range(world)]
        self.single = singles[rank]
        self.pp = {pp: dist.new_group(list(range(pp))) if pp > 1 else self.single for pp in sizes}
        self.sockets = {}
        if sockets:
            self.sockets[sockets] = dist.new_group(list(range(sockets)))
            if rank < sockets:  # a group's first communicator fixes its transport, here with the switch off
                users = os.environ.get(shared_memory_p2p.ENV_SWITCH)
                os.environ[shared_memory_p2p.ENV_SWITCH] = "0"
                P2PCommunicator(self.sockets[sockets], None)
                if users is None:
                    del os.environ[shared_memory_p2p.ENV_SWITCH]
                else:
                    os.environ[shared_memory_p2p.ENV_SWITCH] = users

    def collection(self, pp: int, sockets: bool = False) -> ProcessGroupCollection:
        """Groups for a tp = cp = dp = 1 run over ranks 0..pp-1 (untied embeddings: no embd group);
        ``sockets``: its pipeline group the one on gloo's sockets."""
        one, pipe = self.single, (self.sockets if sockets else self.pp)[pp]
        return ProcessGroupCollection(
            tp=one, pp=pipe, mp=pipe, cp=one, tp_cp=one, dp=one, dp_cp=one, tp_dp_cp=one,
            ep=one, expt_tp=one, tp_ep=one, tp_ep_pp=pipe, expt_dp=one,
        )  # fmt: skip


def ours(
    make_provider,
    groups: Groups,
    pp: int,
    microbatches,
    batches,
    mbs: int,
    vp: int = 1,
    sockets: bool = False,
):
    """{m: run()} on this rank of a pp-stage pipeline (``make_provider(pp, vp=vp)`` its GPT, ``vp``
    model chunks per rank: interleaved 1F1B when > 1; ``sockets``: p2p over gloo's sockets), one
    model and optimizer shared by every microbatch count ``m``; each run is one megatron_lite
    train_step. Collective over the pipeline."""
    pgc = groups.collection(pp, sockets)
    cfg = make_provider(pp, vp=vp)
    cfg._pg_collection = pgc
    chunks = [
        DistributedDataParallel(cfg, cfg.provide(vp_stage=c if vp > 1 else None), dp_group=pgc.dp_cp)
        for c in range(vp)
    ]
    cfg.no_sync_func = partial(_no_sync_all, chunks)  # as pretrain.py's setup
    cfg.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=pgc)
    opt_cfg = OptimizerConfig(bf16=cfg.bf16)
    optimizer = MegatronOptimizer(opt_cfg, chunks, model_parallel_group=pgc.mp, tp_group=pgc.tp)
    runs = {}
    for m in microbatches:
        config = ConfigContainer(model=cfg, optimizer=opt_cfg)
        config.train.micro_batch_size, config.train.global_batch_size = mbs, m * mbs
        config.train.train_iters = 10**6  # the learning-rate schedule never ends during a bench
        config.dataset.sequence_length = cfg.seq_length
        config.data_parallel_size = 1
        state = GlobalState(config)
        scheduler = get_optimizer_param_scheduler(config, optimizer)
        step = partial(forward_step, state)

        def run(config=config, state=state, scheduler=scheduler, step=step, m=m):
            data = [iter(batches[:m]) for _ in chunks] if vp > 1 else iter(batches[:m])
            losses, *_ = train_step(step, data, chunks, optimizer, scheduler, config, state.timers, pgc)
            loss = losses.get("lm loss")  # only the last stage has it
            return None if loss is None else float(loss)

        runs[m] = run
    return runs


def peer(make_provider, groups: Groups, pp: int, batches, microbatches: int, vp: int = 1):
    """run() for torch.distributed.pipelining's Schedule1F1B (ScheduleInterleaved1F1B with ``vp``
    chunks per rank, stage index c * pp + rank) over ranks 0..pp-1, followed by the global grad-norm
    clip (fp64 squares, all-reduced over the pipeline) and torch's AdamW with our optimizer's
    hyper-parameters. Collective over the pipeline."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    pipe, rank = groups.pp[pp], dist.get_rank()
    cfg = make_provider(pp, vp=vp)
    cfg._pg_collection = groups.collection(pp)
    modules = [TorchPipelineStage(cfg.provide(vp_stage=c if vp > 1 else None)) for c in range(vp)]
    device = torch.device("cpu")
    stages = [PipelineStage(m, c * pp + rank, pp * vp, device, group=pipe) for c, m in enumerate(modules)]
    if vp > 1:
        schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=peer_loss)
    else:
        schedule = Schedule1F1B(stages[0], microbatches, loss_fn=peer_loss)
    o = OptimizerConfig()
    params = [p for module in modules for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
    )
    first, last = rank == 0, rank == pp - 1
    tokens = torch.cat([b["tokens"] for b in batches[:microbatches]])
    labels = torch.cat([b["labels"] for b in batches[:microbatches]])

    def run():
        optimizer.zero_grad(set_to_none=True)
        losses = []
        if first:
            schedule.step(tokens)
        elif last:
            schedule.step(target=labels, losses=losses)
        else:
            schedule.step()
        total = torch.zeros(1, dtype=torch.float64)
        for p in params:
            total += p.grad.detach().double().square().sum()
        dist.all_reduce(total, group=pipe)
        coeff = o.clip_grad / (math.sqrt(total.item()) + 1.0e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
        optimizer.step()
        return torch.stack(losses).mean().item() if last else None

    return run


def cpu_matmul_kernels() -> dict[str, str]:
    """What this CPU has and which kernel runs one bf16 and one fp32 linear (256x256 @ 256x1024):
    oneDNN's verbose log names the implementation; fp32 matmuls go to MKL/ATen, not oneDNN. Runs in
    a fresh interpreter (ONEDNN_VERBOSE is read once, at oneDNN's first call)."""
    import subprocess
    import sys

    code = (
        "import torch; a = torch.randn(256, 256); w = torch.randn(1024, 256)\n"
        "for dtype in (torch.bfloat16, torch.float32):\n"
        "    print('dtype', dtype, flush=True); torch.nn.functional.linear(a.to(dtype), w.to(dtype))\n"
        "    print(flush=True)\n"
        "print('capability', torch.backends.cpu.get_cpu_capability())\n"
        "print('mkldnn', torch.backends.mkldnn.is_available())\n"
    )
    env = {**os.environ, "ONEDNN_VERBOSE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    report, current = {}, None
    for line in out.splitlines():
        if line.startswith("dtype "):
            current = line.split(".")[-1]
            report[current] = "no oneDNN primitive (MKL / ATen GEMM)"
        elif current and ",primitive,exec," in line:
            report[current] = "oneDNN " + line.split(",")[6]  # the implementation, e.g. brg_matmul:..._amx
        elif line.startswith(("capability", "mkldnn")):
            key, value = line.split(" ", 1)
            report[key] = value
    flags = cpu_flags() or set()
    report["cpu flags"] = " ".join(f"{flag}:{'yes' if flag in flags else 'no'}" for flag in BF16_MATRIX_FLAGS)
    return report
