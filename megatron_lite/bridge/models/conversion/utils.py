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


def unwrap_model(model):
    """The model chunk(s) inside their wrappers (DDP, Float16Module: ``.module``), a list for a list."""
    if isinstance(model, list):
        return [unwrap_model(chunk) for chunk in model]
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def conform_config_to_reference(hf_config_dict: dict, reference_config: dict) -> dict:
    """``hf_config_dict`` limited to the reference config's keys (nested dicts likewise), with the
    reference's values for the keys it lacks: a synthesized config written as the reference writes it."""
    conformed = {}
    for key, value in hf_config_dict.items():
        if key in reference_config:
            reference = reference_config[key]
            if isinstance(value, dict) and isinstance(reference, dict):
                value = conform_config_to_reference(value, reference)
            conformed[key] = value
    for key, value in reference_config.items():
        conformed.setdefault(key, value)
    return conformed
