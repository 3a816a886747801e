#!/usr/bin/env python
"""--cross-entropy-loss-fusion against the unfused output layer and loss, side by side in one run.

    python bench/fused_cross_entropy.py

For a few shapes on this machine's CPU (one process, fp32 and bf16): the median iteration time of each
path over rounds that alternate them, their ratio, and the output layer's share of the step's matmul
work (the fused path runs the output layer's GEMM once more in backward, so its extra time is about a
third of that share). Then, for docs/memory.md's Llama-3-70B-shaped job (tp 8 x pp 8, seq 8192, bf16), the
last stage's predicted temporaries: the logits-sized ones (the unfused [s, b, V/tp] logits and their fp32
copy at the loss, the softmax as the gradient in backward; the fused path's one chunk) and the stage's
temporaries at its peak, beside the dry run's peak. No timing is asserted anywhere.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

SHAPES = {
    "h 256, 2 layers, V 32768 (the output layer dominates)": "--num-layers 2 --hidden-size 256",
    "h 512, 8 layers, V 32768": "--num-layers 8 --hidden-size 512",
    "h 512, 8 layers, V 8192": "--num-layers 8 --hidden-size 512 --vocab-size 8192",
}
COMMON = (
    "--num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 --vocab-size 32768 "
    "--micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --min-lr 1e-4 --train-iters 6 --log-interval 1"
)
ROUNDS = 2
_TIME = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def iteration_ms(args: list[str]) -> list[float]:
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "pretrain.py"), *args], capture_output=True, text=True, check=True
    ).stdout
    return [float(t) for t in _TIME.findall(out)[1:]]  # the first iteration allocates the state


def matmul_share(args: list[str]) -> float:
    """The output layer's share of the step's GEMM flops (per token: 24 h^2 a layer, 6 h V)."""
    value = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    h, layers, vocab = (int(value[k]) for k in ("--hidden-size", "--num-layers", "--vocab-size"))
    return 6 * h * vocab / (layers * 24 * h * h + 6 * h * vocab)


def timing() -> None:
    print(f"{'shape':<56} {'dtype':>5} {'out%':>5} {'plain ms':>9} {'fused ms':>9} {'ratio':>6}")
    for name, shape in SHAPES.items():
        for dtype in ("fp32", "bf16"):
            args = [*COMMON.split(), *shape.split(), *(["--bf16"] if dtype == "bf16" else [])]
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(ROUNDS):
                for fused in (False, True):
                    times[fused] += iteration_ms([*args, *(["--cross-entropy-loss-fusion"] if fused else [])])
            plain, fused = (statistics.median(times[f]) for f in (False, True))
            print(
                f"{name:<56} {dtype:>5} {100 * matmul_share(args):5.0f} {plain:9.1f} {fused:9.1f} "
                f"{fused / plain:6.2f}"
            )


LLAMA_70B = (
    "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 --sequence-parallel "
    "--use-distributed-optimizer --num-layers 80 --hidden-size 8192 --num-attention-heads 64 "
    "--seq-length 8192 --max-position-embeddings 8192 --ffn-hidden-size 28672 --swiglu --normalization RMSNorm "
    "--norm-epsilon 1e-5 --position-embedding-type rope --rotary-base 500000 --group-query-attention "
    "--num-query-groups 8 --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 "
    "--make-vocab-size-divisible-by 128 --micro-batch-size 1 --global-batch-size 64 --bf16 --nproc-per-node 128"
)


def llama_70b() -> None:
    from megatron_lite.run_modes.dry_run import dry_run_stages
    from megatron_lite.training.arguments import config_from_argv
    from megatron_lite.training.memory.predict import temporaries as temps
    from megatron_lite.training.memory.predict.activations import make_shape, vocab_per_rank
    from megatron_lite.training.memory.predict.stages import predict_memory_per_stage

    print("\nLlama-3-70B-shaped job, last stage (GB, predicted; dry run: measured on fake tensors)")
    print(
        f"{'loss':<8} {'logits-sized':>12} {'loss + output layer':>19} {'a layer bwd':>11} "
        f"{'temp at peak':>12} {'peak':>6} {'dry run':>8}"
    )
    rows = {}
    for fused in (False, True):
        config = config_from_argv([*LLAMA_70B.split(), *(["--cross-entropy-loss-fusion"] if fused else [])])
        x = make_shape(config, device_type="cuda")
        vocab = vocab_per_rank(x)
        if fused:  # one chunk's logits and their fp32 copy (forward), its softmax and cast (backward)
            logits_sized = temps.fused_chunk_tokens(x) * vocab * (x.elt + 4)
            loss = max(temps.fused_loss_forward_extra(x), temps.fused_output_backward_extra(x))
        else:  # the logits and their fp32 copy at the loss; the softmax is the gradient in backward
            logits_sized = max(temps.loss_forward_extra(x), x.tokens * vocab * 4)
            loss = max(temps.loss_forward_extra(x), temps.output_backward_extra(x))
        last = predict_memory_per_stage(config, device_type="cuda")[-1]
        with open(os.devnull, "w") as quiet:
            dry = dry_run_stages(config, "cuda", out=quiet)[-1].max_allocated_bytes
        rows[fused] = (logits_sized, loss, last.temporaries_bytes)
        print(
            f"{'fused' if fused else 'unfused':<8} {logits_sized / 1e9:12.3f} {loss / 1e9:19.3f} "
            f"{temps.layer_backward_extra(x) / 1e9:11.3f} {last.temporaries_bytes / 1e9:12.3f} "
            f"{last.peak_bytes / 1e9:6.2f} {dry / 1e9:8.2f}"
        )
    ratios = [plain / fused for plain, fused in zip(rows[False], rows[True], strict=True)]
    print(
        f"unfused / fused: logits-sized {ratios[0]:.1f}x, loss + output layer {ratios[1]:.1f}x, "
        f"stage temporaries at the peak {ratios[2]:.2f}x"
    )


if __name__ == "__main__":
    timing()
    llama_70b()
