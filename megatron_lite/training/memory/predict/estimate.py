"""Predicted weight-and-optimizer memory, from the model's shape (an estimate, printed as one).

Counts the parameters each rank of a pipeline stage holds with :mod:`.params`' ``chunk_parameters``
(the one parameter counter), summed over the rank's virtual-pipeline chunks: grouped-query QKV, gated
MLPs, LayerNorm or RMSNorm, biases or none, learned positions or rotary, tied or untied output layer,
the padded vocabulary. Column-parallel weights (and their biases) and row-parallel weights are split
over tensor-parallel ranks; norms and row-parallel biases are whole.
"""

from __future__ import annotations

from megatron_lite.training.memory.predict.lora import lora_of
from megatron_lite.training.memory.predict.params import chunk_parameters


def num_parameters_per_rank(m, pp_rank: int) -> int:
    """Parameters one tensor-parallel rank of pipeline stage ``pp_rank`` holds (``m`` a GPTModelProvider)."""
    vp = m.virtual_pipeline_model_parallel_size or 1
    return sum(p.numel for vp_stage in range(vp) for p in chunk_parameters(m, pp_rank, vp_stage))


def _parameters_per_rank(m, pp_rank: int, lora) -> tuple[int, int]:
    """(trainable, frozen) parameters of one tensor-parallel rank of stage ``pp_rank``."""
    vp = m.virtual_pipeline_model_parallel_size or 1
    specs = [p for vp_stage in range(vp) for p in chunk_parameters(m, pp_rank, vp_stage, lora)]
    trainable = sum(p.numel for p in specs if p.trainable)
    return trainable, sum(p.numel for p in specs) - trainable


def report_theoretical_memory(config, num_microbatches: int | None = None, verbose: bool = False) -> float:
    """Print (on the calling rank) and return the weight-and-optimizer memory, in MB, that a rank of
    the most loaded pipeline stage needs: 16 bytes per parameter (fp32 weight, fp32 gradient, two fp32
    Adam moments), 18 with bf16 (plus the bf16 compute copy). The distributed optimizer divides the
    optimizer's share by the data-parallel size: 8 + 8 / dp, or upstream's 6 + 12 / dp with bf16.
    LoRA's frozen base counts its weights only (4 bytes, 2 with bf16). An estimate, not a
    measurement; activation memory is not estimated here."""
    m = config.model
    lora = lora_of(config)
    per_rank = [_parameters_per_rank(m, rank, lora) for rank in range(m.pipeline_model_parallel_size)]
    params, frozen = max(per_rank, key=lambda counts: counts[0] * 16 + counts[1])
    bf16 = getattr(m, "bf16", False)
    bytes_per_param = 18 if bf16 else 16
    if config.optimizer.use_distributed_optimizer:
        dp = config.data_parallel_size * m.context_parallel_size  # sharded over dp x cp
        bytes_per_param = 6 + 12 / dp if bf16 else 8 + 8 / dp
    # LoRA's frozen base: its weights only (no gradient, master or optimizer state).
    megabytes = (params * bytes_per_param + frozen * (2 if bf16 else 4)) / (1024 * 1024)
    params += frozen
    if verbose:
        print(
            f"Theoretical memory footprints: weight and optimizer={megabytes:.2f} MB"
            f" (estimate for {params:.0f} parameters per rank)",
            flush=True,
        )
    return megabytes
