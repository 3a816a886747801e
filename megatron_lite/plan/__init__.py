"""``python -m megatron_lite.plan``: the layout planner (megatron_lite/run_modes/plan/)."""
