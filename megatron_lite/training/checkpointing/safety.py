"""What a checkpoint file may hold, so that loading one can never run code.

``torch.load(weights_only=True)`` rebuilds tensors, containers and numbers and refuses every other
global before calling it. megatron_lite writes nothing else (``plain`` turns the config's callables
into their names and the NumPy RNG state into a tensor) but, in a ``torch_dist`` checkpoint's
``common.pt``, Megatron-LM's ``args`` (an ``argparse.Namespace``, so Megatron-LM can resume it), which
reads back as plain data like everything Megatron-LM writes (megatron_lm_pickles.py). Checkpoints
written before that held a few more objects; ``LEGACY_GLOBALS`` allows exactly those, and only while
one of our files is being read. Anything else is refused with one line
naming the file and the type; nothing in the file has run by then.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import io
import os
import pickle
import re
import warnings
import zipfile

import numpy as np
import torch
import torch.nn.functional as F

from megatron_lite.core.activations import squared_relu
from megatron_lite.core.transformer.enums import LayerType
from megatron_lite.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
from megatron_lite.core.utils import _normal_init
from megatron_lite.training.checkpointing.megatron_lm_pickles import MEGATRON_LM_GLOBALS


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; ``str(err)`` is the one line shown to the user."""


def _numpy_reconstruct():
    core = getattr(np, "_core", None) or np.core  # NumPy 2 renamed numpy.core
    return core.multiarray._reconstruct


# What megatron_lite wrote before checkpoints were plain: NumPy's RNG state (an ndarray, under NumPy 1's
# module name too), the config's activation and init callables (functools.partial of _normal_init) and a
# --pipeline-model-parallel-layout's object. Rebuilding any of them calls no function but a constructor;
# the functions themselves are only referenced, never called (tests/training/checkpointing/test_checkpoint_safety.py walks the
# flags that put objects into the config).
NUMPY_GLOBALS = [
    _numpy_reconstruct(),
    (_numpy_reconstruct(), "numpy.core.multiarray._reconstruct"),
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]
LEGACY_GLOBALS = NUMPY_GLOBALS + [
    functools.partial,
    _normal_init,
    F.gelu,
    F.silu,
    F.relu,
    squared_relu,
    PipelineParallelLayerLayout,
    LayerType,
]


def _callable_name(value) -> str:
    if isinstance(value, functools.partial):
        keywords = ", ".join(f"{k}={v!r}" for k, v in value.keywords.items())
        return f"{_callable_name(value.func)}({keywords})"
    return getattr(value, "__name__", type(value).__name__)


def plain(value):
    """``value`` as containers, numbers, strings, dtypes and tensors only: what weights_only loads.
    Callables become their names (the checkpoint's config records which, it never re-runs them)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        # asdict's own walk, without its copy of a defaultdict (which it cannot rebuild: LoRA's matcher)
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [plain(v) for v in value]
        return items if isinstance(value, list) else tuple(items)
    if isinstance(value, enum.Enum):
        return value.name
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.Tensor)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    if callable(value):
        return _callable_name(value)
    return repr(value)


def _disallowed_globals(path, err: Exception) -> str | None:
    """The globals weights_only refused, read from the file's pickle opcodes (nothing is called), or
    from the unpickler's message; None when it refused something else (a corrupt or foreign pickle)."""
    allowed = {
        g[1] if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"
        for g in LEGACY_GLOBALS + MEGATRON_LM_GLOBALS
    }
    try:
        unsafe = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path) if n not in allowed]
    except Exception:  # a legacy (non-zip) file: the unpickler's message names it
        unsafe = []
    match = re.search(r"GLOBAL ([\w.]+)", str(err))
    return ", ".join(unsafe) if unsafe else (match.group(1) if match else None)


def _unpickler_reason(err: Exception) -> str:
    reason = re.search(
        r"WeightsUnpickler error:\s*(.+?)\s*(?:\n\n|Check the documentation|$)", str(err), re.S
    )
    return reason.group(1).strip().splitlines()[0][:100] if reason else "an unsupported pickle"


def load_checkpoint_file(
    path: str, root: str, legacy: bool = True, mmap: bool = False, data: bytes | None = None
):
    """``torch.load`` of one of our checkpoint files, never running code from it.

    ``legacy``: also allow what older megatron_lite versions wrote into this kind of file
    (LEGACY_GLOBALS; only model_optim_rng.pt ever held them). What Megatron-LM writes into its own
    checkpoints is always allowed, rebuilt as plain data (megatron_lm_pickles.py). ``data``: the file's
    bytes, read from elsewhere (``path`` names them). ``mmap``: map the tensors' storages
    instead of reading them, so that a caller taking a few tensors (or only the config) of a big
    shard reads only those pages (a file of torch's older, non-zip format is read whole). Raises
    CheckpointError (one line, naming ``path`` relative to ``root``) for a file that holds a type
    megatron_lite does not write, and for a corrupt or truncated file.
    """
    shard = os.path.relpath(path, root)
    try:
        # Megatron-LM's own allowlist has NumPy's arrays too (its RNG states).
        allowed = (LEGACY_GLOBALS if legacy else NUMPY_GLOBALS) + MEGATRON_LM_GLOBALS
        with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's note on pickle protocols: the refusal says it all
            if data is not None:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            mmap = mmap and zipfile.is_zipfile(path)  # torch maps only its zip format
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "weights only load failed" not in str(err).lower():
            raise CheckpointError(
                f"--load {root}: cannot read {shard} (UnpicklingError); the file is corrupt"
            ) from None
        disallowed = _disallowed_globals(path if data is None else io.BytesIO(data), err)
        if disallowed is None:
            raise CheckpointError(
                f"--load {root}: cannot read {shard} ({_unpickler_reason(err)}); the file is corrupt or "
                "was not written by megatron_lite"
            ) from None
        raise CheckpointError(
            f"--load {root}: refusing {shard}: it holds {disallowed}, which neither megatron_lite nor "
            "Megatron-LM writes and loading could run code; nothing in it was run"
        ) from None
    except Exception as err:  # torch raises many types for truncated or garbage files
        raise CheckpointError(
            f"--load {root}: cannot read {shard} ({type(err).__name__}); the file is corrupt or truncated"
        ) from None
