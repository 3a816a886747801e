"""The layout planner: which tp / pp / vp / cp / ep / dp, sequence parallelism, recompute, distributed
optimizer and fused loss to use for a job on N GPUs of G GB.

    python -m megatron_lite.plan --recipe llama3_70b_pretrain_config --gpus 32 --device-memory-gb 80
    python -m megatron_lite.plan --gpus 8 --device-memory-gb 80 -- <pretrain.py flags>

- layouts.py: the layouts searched (and what is not searched, and why), each a real ConfigContainer;
- search.py: each validated, predicted with the preflight's own judgement (preflight_json.py), kept
  when every stage fits with the reserve; what a cheaper fitting lever set dominates is pruned;
- figures.py: the ranking's figures, none a time: the bubble, recompute's FLOPs, bytes per GPU;
- confirm.py: the best distinct splits run by the dry run (dry_run/), within 2% of the prediction;
- report.py, record.py: the plan in words, as JSON and as a picture; planner.py, cli.py: the mode.
"""

from megatron_lite.run_modes.plan.cli import main
from megatron_lite.run_modes.plan.planner import Plan, make_plan

__all__ = ["Plan", "main", "make_plan"]
