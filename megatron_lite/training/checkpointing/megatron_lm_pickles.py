"""What Megatron-LM pickles into its checkpoints, rebuilt as plain data.

Megatron-LM's loader lets torch's weights-only unpickler rebuild a few classes besides tensors and
containers (``megatron/core/safe_globals.py``): its parsed command line (``argparse.Namespace``), config
objects, enums, paths. ``MEGATRON_LM_GLOBALS`` gives torch's weights-only unpickler a stand-in under
each of those names: a Namespace or a config object comes back as a dict of its fields, an enum as its
member's name, a path as a string, a ``BytesIO`` as its bytes, a torch Generator as nothing. Nothing of
Megatron-LM or torch is built from a file but these stand-ins; any other class is still refused.
"""

from __future__ import annotations

import os
import signal


class SavedFields(dict):
    """An ``argparse.Namespace``, ``types.SimpleNamespace`` or Megatron-LM config dataclass rebuilt as
    a dict of its fields (the unpickler creates it empty, then hands it the object's ``__dict__``)."""

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (__dict__, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.update(state if isinstance(state, dict) else {})


class SavedBytes:
    """An ``io.BytesIO`` rebuilt as its contents, ``value`` (its pickled state is ``(value, position,
    dict)``)."""

    __slots__ = ("value",)

    def __setstate__(self, state) -> None:
        value = state[0] if isinstance(state, tuple) and state else b""
        self.value = bytes(value) if isinstance(value, (bytes, bytearray)) else b""


class SavedGenerator:
    """A torch Generator (in Megatron-LM's RNG tracker states) rebuilt as nothing: its state is not
    carried, and a real one would take its device from the file (CUDA, on a host that may have none)."""

    def __init__(self, *args) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


def _path(*parts) -> str:
    return os.path.join(*map(str, parts)) if parts else ""


def _enum(name: str, members: dict):
    """An enum member's pickle is its class called with its value: here the member's name comes back."""

    def rebuild(value):
        return members.get(value, f"{name}({value!r})")

    rebuild.__name__ = name
    return rebuild


def _signal(value) -> str:
    try:
        return signal.Signals(value).name
    except ValueError:
        return f"Signals({value!r})"


def _by_value(*names: str, start: int = 1) -> dict:
    return {i: name for i, name in enumerate(names, start)}


_CUDA_GRAPH_MODULES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
_RERUN_MODES = {"disabled": "DISABLED", "validate_results": "VALIDATE_RESULTS"}
_RERUN_MODES["report_determinism_stats"] = "REPORT_DETERMINISM_STATS"
_RERUN_DIAGNOSTICS = {v: v.upper() for v in ("correct_result", "transient_error", "persistent_error")}
_RERUN_STATES = _by_value(
    "NOT_RUNNING_YET",
    "INITIAL_RUN",
    "RERUNNING_IN_PLACE",
    "WILL_RERUN_FROM_CHECKPOINT",
    "RERUNNING_FROM_CHECKPOINT",
    "RERUNNING_AGAIN_FROM_CHECKPOINT",
    start=0,
)

# Megatron-LM's SAFE_GLOBALS (megatron/core/safe_globals.py) beyond what safety.LEGACY_GLOBALS already
# allows (NumPy's array rebuilding), each under its own name, as (stand-in, name).
MEGATRON_LM_GLOBALS = [
    (SavedFields, "argparse.Namespace"),
    (SavedFields, "types.SimpleNamespace"),
    (SavedFields, "megatron.core.optimizer.OptimizerConfig"),
    (SavedFields, "megatron.core.optimizer.optimizer_config.OptimizerConfig"),
    (_path, "pathlib.PosixPath"),
    (SavedBytes, "_io.BytesIO"),
    (_signal, "signal.Signals"),
    (_enum("ModelType", {1: "encoder_or_decoder"}), "megatron.core.enums.ModelType"),
    (
        _enum("AttnBackend", _by_value("flash", "fused", "unfused", "local", "auto")),
        "megatron.core.transformer.enums.AttnBackend",
    ),
    (
        _enum("CudaGraphModule", _by_value(*_CUDA_GRAPH_MODULES)),
        "megatron.core.transformer.enums.CudaGraphModule",
    ),
    (
        _enum(
            "CudaGraphScope", _by_value("full_iteration", *_CUDA_GRAPH_MODULES, "full_iteration_inference")
        ),
        "megatron.core.transformer.enums.CudaGraphScope",
    ),
    (
        _enum("InferenceCudaGraphScope", _by_value("none", "layer", "block")),
        "megatron.core.transformer.enums.InferenceCudaGraphScope",
    ),
    (_enum("RerunMode", _RERUN_MODES), "megatron.core.rerun_state_machine.RerunMode"),
    (_enum("RerunState", _RERUN_STATES), "megatron.core.rerun_state_machine.RerunState"),
    (_enum("RerunDiagnostic", _RERUN_DIAGNOSTICS), "megatron.core.rerun_state_machine.RerunDiagnostic"),
    (SavedGenerator, "torch._C.Generator"),
]
