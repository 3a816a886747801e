#!/usr/bin/env python
"""megatron_lite's 1F1B against torch.distributed.pipelining.Schedule1F1B, same model, same processes.

    python bench/pipeline_vs_torch_pipelining.py [--rounds 6]

GPT: 8 layers, hidden 256, 8 heads, seq 128, micro-batch 2, global batch 16 (8 microbatches), vocab
8192, fp32, pp = 4 on CPU with gloo. Both schedules run identical stage modules (untied embeddings, so
neither pays for an embedding all-reduce) and are alternated round by round. Prints the median
ms per global-batch forward-backward for each, their ratio, and each stage's peak bytes of activations
saved for backward (measured by megatron_lite's ActivationMemoryTracker around each schedule).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_lite.core import parallel_state as ps  # noqa: E402
from megatron_lite.core.datasets.gpt_dataset import MockGPTDataset  # noqa: E402
from megatron_lite.core.distributed import DistributedDataParallel, finalize_model_grads  # noqa: E402
from megatron_lite.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron_lite.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron_lite.core.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402
from megatron_lite.models.gpt_provider import GPTModelProvider  # noqa: E402
from megatron_lite.training.config import ConfigContainer  # noqa: E402
from megatron_lite.training.gpt_step import forward_step  # noqa: E402
from megatron_lite.training.state import GlobalState  # noqa: E402
from megatron_lite.training.utils.activation_memory import ActivationMemoryTracker  # noqa: E402

PP, LAYERS, HIDDEN, HEADS, SEQ, MBS, GBS, VOCAB = 4, 8, 256, 8, 128, 2, 16, 8192
MICROBATCHES = GBS // MBS


class TorchPipelineStage(nn.Module):
    """A GPTModel stage with the plain tensor-in / tensor-out forward torch.distributed.pipelining wants."""

    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt

    def forward(self, x):
        g = self.gpt
        hidden = g.embedding(x, torch.arange(SEQ).expand_as(x)) if g.pre_process else x
        hidden = g.decoder(hidden)
        return g.output_layer(hidden)[0] if g.post_process else hidden


def _loss(logits, labels):
    return vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).mean()


def _provider():
    return GPTModelProvider(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        vocab_size=VOCAB,
        seq_length=SEQ,
        max_position_embeddings=SEQ,
        pipeline_model_parallel_size=PP,
        share_embeddings_and_output_weights=False,
    )


def _batches(n):
    data = MockGPTDataset(vocab_size=VOCAB, sequence_length=SEQ, seed=1, num_samples=n * MBS)
    return [{k: torch.stack([data[i * MBS + j][k] for j in range(MBS)]) for k in data[0]} for i in range(n)]


def worker(rank, port, rounds, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PP))
    dist.init_process_group("gloo", rank=rank, world_size=PP)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    ps.initialize_model_parallel(pipeline_model_parallel_size=PP)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    cfg = _provider()
    ours = DistributedDataParallel(cfg, cfg.provide(pre_process=first, post_process=last), dp_group=pgc.dp)
    cfg.finalize_model_grads_func = finalize_model_grads
    peer_module = TorchPipelineStage(_provider().provide(pre_process=first, post_process=last))
    peer_stage = PipelineStage(peer_module, rank, PP, torch.device("cpu"), group=pgc.pp)
    peer = Schedule1F1B(peer_stage, MICROBATCHES, loss_fn=_loss)
    schedule = get_forward_backward_func()
    batches = _batches(MICROBATCHES)

    def run_ours(tracker):
        ours.zero_grad_buffer()
        with tracker.track():
            schedule(
                forward_step_func=partial(forward_step, GlobalState(ConfigContainer())),
                data_iterator=iter(batches),
                model=ours,
                num_microbatches=MICROBATCHES,
                seq_length=SEQ,
                micro_batch_size=MBS,
            )

    def run_peer(tracker):
        peer_module.zero_grad(set_to_none=True)
        tokens = torch.cat([b["tokens"] for b in batches]) if first else None
        labels = torch.cat([b["labels"] for b in batches]) if last else None
        with tracker.track():
            if first:
                peer.step(tokens)
            elif last:
                peer.step(target=labels, losses=[])
            else:
                peer.step()

    times = {"megatron_lite": [], "torch.pipelining": []}
    peaks = {}
    for name, run, module in (
        ("megatron_lite", run_ours, ours.module),
        ("torch.pipelining", run_peer, peer_module),
    ):
        tracker = ActivationMemoryTracker()
        tracker.exclude_parameters(module.parameters())
        run(tracker)  # warm-up round also measures the activation peak
        peaks[name] = tracker.peak_bytes
    for _ in range(rounds):
        for name, run in (("megatron_lite", run_ours), ("torch.pipelining", run_peer)):
            tracker = ActivationMemoryTracker()
            dist.barrier()
            start = time.perf_counter()
            run(tracker)
            dist.barrier()
            times[name].append(time.perf_counter() - start)
    queue.put((rank, times, peaks))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per schedule")
    args = parser.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.rounds, queue)) for r in range(PP)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=1800) for _ in range(PP))
    for p in procs:
        p.join()
    times = results[-1][1]
    ms = {name: statistics.median(v) * 1000 for name, v in times.items()}
    print(
        f"GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, seq {SEQ}, micro-batch {MBS}, global batch {GBS}, "
        f"vocab {VOCAB}, fp32, pp {PP}, CPU/gloo, {args.rounds} alternated rounds"
    )
    print(f"{'schedule':<18}{'ms/iteration':>14}")
    for name, value in ms.items():
        print(f"{name:<18}{value:>14.1f}")
    print(
        f"ratio megatron_lite / torch.pipelining: {ms['megatron_lite'] / ms['torch.pipelining']:.3f} "
        f"(< 1 means megatron_lite is faster)"
    )
    print(
        f"{'stage':<7}{'megatron_lite act. peak (MB)':>30}{'torch.pipelining act. peak (MB)':>34}{'ratio':>8}"
    )
    for rank, _, peaks in results:
        a, b = peaks["megatron_lite"] / 1e6, peaks["torch.pipelining"] / 1e6
        print(f"{rank:<7}{a:>30.2f}{b:>34.2f}{a / b:>8.3f}")


if __name__ == "__main__":
    main()
