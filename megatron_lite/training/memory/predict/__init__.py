"""The memory prediction: a pure function of the config, no world and no model built.

- params.py: the parameters each model chunk builds, its gradient buffers and optimizer state;
- activations.py: what each layer and chunk saves for backward, played over the pipeline schedule;
- lora/: LoRA's frozen base and adapters (targets.py: which linears and their adapters' parameters;
  saves.py: what a layer saves with them);
- stages.py: every pipeline stage's prediction (the formulas' derivation is its docstring);
- estimate.py: upstream's weight-and-optimizer estimate (``report_theoretical_memory``).
"""

from megatron_lite.training.memory.predict.estimate import report_theoretical_memory
from megatron_lite.training.memory.predict.stages import (
    PREDICTED_KEYS,
    StageMemoryPrediction,
    predict_memory_per_stage,
    predicted_memory_metrics,
)

__all__ = [
    "PREDICTED_KEYS",
    "StageMemoryPrediction",
    "predict_memory_per_stage",
    "predicted_memory_metrics",
    "report_theoretical_memory",
]
