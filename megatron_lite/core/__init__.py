"""Megatron core equivalents: parallel state, tensor/pipeline/data parallelism, models, optimizer."""


def __getattr__(name: str):
    # Lazy, as ``from megatron.core import ModelParallelConfig`` upstream, without importing the
    # config (and torch) whenever any megatron_lite.core submodule is imported.
    if name == "ModelParallelConfig":
        from megatron_lite.core.model_parallel_config import ModelParallelConfig

        return ModelParallelConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
