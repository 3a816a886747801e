"""Process environment defaults every hardware recipe sets (Megatron-Bridge's
``recipes.utils.environment_utils``). ConfigContainer.env_vars applies them with ``setdefault``:
values already in the environment win. On a CPU run they are inert (NCCL and CUDA settings)."""

COMMON_RECIPE_ENV_VARS: dict[str, str | int | float | bool] = {
    "NCCL_GRAPH_REGISTER": 0,
    "NCCL_NVLS_ENABLE": 0,
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": 1,
    "TORCH_NCCL_HIGH_PRIORITY": 1,
}
