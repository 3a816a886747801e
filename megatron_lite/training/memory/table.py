"""The end-of-run memory table: each stage's final report, measured, beside its prediction."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.distributed as dist

from megatron_lite.training.memory.pipeline import gather_memory_across_pp_group, print_rank_last
from megatron_lite.training.memory.predict.stages import predict_memory_per_stage
from megatron_lite.training.memory.report import report_memory

if TYPE_CHECKING:
    from megatron_lite.training.config import ConfigContainer

# Measured key -> the prediction printed beside it in the memory table.
PREDICTED_BESIDE = {
    "mem-max-activation-gigabytes": "activation_bytes",
    "mem-optimizer-state-gigabytes": "optimizer_state_bytes",
    "mem-weights-gigabytes": "weights_bytes",
    "mem-grads-gigabytes": "grads_bytes",
}


def print_memory_table(config: ConfigContainer, pg_collection) -> None:
    """Each stage's final memory report, as a table on the last rank, each stage followed by a
    "predicted" row (theoretical_memory's prediction, under the measured keys it predicts).
    Collective over the pp group."""
    peak, stages = gather_memory_across_pp_group(report_memory(config.logger.memory_keys), pg_collection.pp)
    # The table shows the last rank's pipeline: predict for its dp x cp rank.
    dp_cp = pg_collection.dp_cp
    predictions = predict_memory_per_stage(config, dp_rank=0 if dp_cp is None else dist.get_rank(dp_cp))
    names = list(peak)
    header = "stage      " + "  ".join(f"{n:>28}" for n in names)
    rows = []
    for i, s in enumerate(stages):
        rows.append(f"{i:>5}      " + "  ".join(f"{s[n]:>28}" for n in names))
        predicted = [
            f"{getattr(predictions[i], PREDICTED_BESIDE[n]) / 1e9:>28.5g}"
            if n in PREDICTED_BESIDE
            else f"{'':>28}"
            for n in names
        ]
        p, missing = predictions[i], [k for k in PREDICTED_BESIDE if k not in names]
        extra = "".join(f" {k[4:-10]} {getattr(p, PREDICTED_BESIDE[k]) / 1e9:.5g}" for k in missing)
        rows.append(
            f"{i:>5} pred " + "  ".join(predicted) + f"  (predicted{extra} total {p.total_bytes / 1e9:.5g})"
        )
    rows.append("  max      " + "  ".join(f"{peak[n]:>28}" for n in names))
    title = " memory per pipeline stage (GB; 'pred' rows: theoretical_memory's prediction, not measured):"
    print_rank_last("\n".join([title, header, *rows]))
