"""What the preflight and dry-run tests share: a job whose first stage is the heaviest, the README's
cluster example as flags, and the predicted peaks read from the preflight's table."""

from __future__ import annotations

import re
import shlex

from dist_helpers import REPO

FIRST_STAGE_HEAVY = (
    "--num-layers 8 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 16384 --vocab-size 1024 --micro-batch-size 4 --global-batch-size 32 "
    "--pipeline-model-parallel-size 4 --nproc-per-node 4 --recompute-granularity full "
    "--recompute-method uniform --recompute-num-layers 1"
).split()


def readme_cluster_argv() -> list[str]:
    """The flags of the README's torchrun example (32 layers, hidden 4096, tp 4 x pp 4, 16 ranks)."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"torchrun --nnodes 2 --nproc-per-node 8 .*?\n(.*?)```", text, re.S).group(0)
    command = shlex.split(block.replace("\\\n", " ").split("```")[0])
    return command[command.index("pretrain.py") + 1 :] + ["--nproc-per-node", "16"]


def predicted_table(stdout: str) -> dict[int, float]:
    """Stage -> predicted allocated peak in GB, from the printed table."""
    number = r"\s+(-?[\d.]+(?:e-?\d+)?)"
    rows = re.findall(r"^\s+(\d+)" + number * 7 + "$", stdout, re.M)
    return {int(r[0]): float(r[6]) for r in rows}
