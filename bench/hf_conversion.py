#!/usr/bin/env python
"""Hugging Face <-> megatron_lite conversion at a size where memory shows: time, each process's peak
RSS beside the model's and the largest shard's bytes, and whether the round trip is bitwise.

    python bench/hf_conversion.py [--hidden 1536 --layers 12 --vocab 32000 --tp 2 --pp 2]

Writes a Llama-shaped model directory (config.json and random fp32 safetensors files of at most 500 MB,
with their index; no transformers needed), then runs tools/checkpoint_conversion.py import (tp x pp
workers) and export, each as a user would. The peak RSS is the largest of the tool's processes
(launcher and workers: ``RUSAGE_CHILDREN`` of a wrapper); the same tool on a one-layer model of width
64 gives the processes' own footprint (torch, the framework), so peak minus that is what the weights
cost.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file, save_file

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOOL = os.path.join(REPO, "tools", "checkpoint_conversion.py")
MAX_FILE_BYTES = 500 * 1024**2
_PEAK = "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"


def write_llama(path: str, hidden: int, layers: int, vocab: int, heads: int, kv: int) -> tuple[int, int]:
    """A random Llama directory; returns (total bytes, largest tensor bytes)."""
    ffn, head_dim = int(hidden * 8 / 3) // 64 * 64, hidden // heads
    os.makedirs(path, exist_ok=True)
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden), p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden), p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden), p + "mlp.down_proj.weight": (hidden, ffn),
        })  # fmt: skip
    files, pending, pending_bytes, weight_map = [], {}, 0, {}
    generator = torch.Generator().manual_seed(0)

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(pending, os.path.join(path, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update(dict.fromkeys(pending, name))

    for name, shape in shapes.items():
        tensor = torch.randn(shape, generator=generator) * 0.02
        if pending and pending_bytes + tensor.nbytes > MAX_FILE_BYTES:
            flush()
            pending, pending_bytes = {}, 0
        pending[name], pending_bytes = tensor, pending_bytes + tensor.nbytes
    flush()
    sizes = [torch.Size(s).numel() * 4 for s in shapes.values()]
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}, f)
    return sum(sizes), max(sizes)


def run_tool(*args, cwd) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes of the tool's largest process)."""
    start = time.perf_counter()
    job = subprocess.run(
        [sys.executable, "-c", _PEAK, sys.executable, TOOL, *args, "--quiet"],
        cwd=cwd,
        capture_output=True,
        text=True,
    )
    if job.returncode != 0:
        sys.exit(f"{' '.join(args[:1])} failed:\n{job.stderr[-2000:]}")
    return time.perf_counter() - start, int(job.stdout.strip().splitlines()[-1]) * 1024


def read_all(path: str) -> dict:
    index = os.path.join(path, "model.safetensors.index.json")
    if not os.path.exists(index):  # one file
        return load_file(os.path.join(path, "model.safetensors"))
    with open(index) as f:
        files = set(json.load(f)["weight_map"].values())
    out = {}
    for name in sorted(files):
        out.update(load_file(os.path.join(path, name)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    args = parser.parse_args()
    mib = 1024**2
    with tempfile.TemporaryDirectory(prefix="hf_conversion_") as root:
        heads = args.hidden // 128
        total, largest = write_llama(os.path.join(root, "hf"), args.hidden, args.layers, args.vocab, heads, 4)
        write_llama(os.path.join(root, "tiny"), 64 * args.tp, args.pp, 256, 2 * args.tp, args.tp)
        layout = [
            "--tensor-model-parallel-size",
            str(args.tp),
            "--pipeline-model-parallel-size",
            str(args.pp),
        ]
        _, footprint = run_tool(
            "import", "--hf-model", "tiny", "--megatron-path", "tiny_ckpt", *layout, cwd=root
        )
        import_s, import_peak = run_tool(
            "import", "--hf-model", "hf", "--megatron-path", "ckpt", *layout, cwd=root
        )
        export_s, export_peak = run_tool(
            "export", "--hf-model", "hf", "--megatron-path", "ckpt", "--hf-path", "out", cwd=root
        )
        shards = [
            os.path.getsize(os.path.join(d, "model_optim_rng.pt"))
            for d, _, names in os.walk(os.path.join(root, "ckpt"))
            if "model_optim_rng.pt" in names
        ]
        source, exported = read_all(os.path.join(root, "hf")), read_all(os.path.join(root, "out"))
        bitwise = source.keys() == exported.keys() and all(
            torch.equal(source[k], exported[k]) for k in source
        )
    print(
        f"model: Llama-shaped, hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {total / mib:.0f} MiB fp32"
    )
    print(
        f"largest tensor {largest / mib:.0f} MiB; largest shard at tp {args.tp} pp {args.pp}: {max(shards) / mib:.0f} MiB"
    )
    print(f"the tool's processes without weights (a model of a few kB): peak RSS {footprint / mib:.0f} MiB")
    print(f"{'step':<8}{'wall s':>8}{'peak RSS MiB':>14}{'minus footprint':>17}{'/ largest shard':>17}")
    for step, seconds, peak in (("import", import_s, import_peak), ("export", export_s, export_peak)):
        extra = peak - footprint
        print(f"{step:<8}{seconds:>8.1f}{peak / mib:>14.0f}{extra / mib:>17.0f}{extra / max(shards):>17.2f}")
    print(f"export of the import is bitwise the source: {bitwise} ({len(source)} tensors)")


if __name__ == "__main__":
    main()
