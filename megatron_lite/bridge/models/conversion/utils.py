"""Small helpers of Megatron-Bridge's ``conversion/utils.py`` that the mappings use."""

from __future__ import annotations

import torch


def get_module_and_param_from_name(models, param_name: str, vp_stage: int | None = None):
    """(owning module, parameter) for a dotted name, absolute or relative to ``models`` (a module or a
    list of virtual-pipeline chunks): the longest suffix of the name found under the module wins."""
    if isinstance(models, list):
        models = models[vp_stage or 0]
    parts = param_name.split(".")
    for start in range(len(parts)):
        module = models
        try:
            for part in parts[start:-1]:
                module = getattr(module, part)
            param = getattr(module, parts[-1])
        except AttributeError:
            continue
        if isinstance(param, torch.Tensor):
            return module, param
    raise ValueError(f"parameter {param_name} not found in {type(models).__name__}")
