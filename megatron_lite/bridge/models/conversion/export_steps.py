"""The steps of MegatronModelBridge's export loop that look at one task's converted tensors (Megatron-
Bridge's private helpers, by their names): dropping the vocabulary's padding rows, stacking routed
experts into one fused Hugging Face tensor, the Hugging Face name of a tied output layer, the dtype."""

from __future__ import annotations

import gc
import logging
import math
import re

import torch

logger = logging.getLogger(__name__)

_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_VOCAB_HF_PARAMS = ("embed_tokens.weight", "word_embeddings.weight", "lm_head.weight", "head.weight")
# Where a multimodal or nested config keeps the language model's vocabulary.
_NESTED_CONFIGS = ("text_config", "llm_config", "thinker_config")
_EXPERT_NUMBER = (r"local_experts\.(\d+)", r"(?:weight|bias)(\d+)", r"experts\.(\d+)")


def extract_expert_number_from_param(param_name: str) -> int:
    """The expert index in a parameter's name (``local_experts.<i>.`` or ``weight<i>``)."""
    for pattern in _EXPERT_NUMBER:
        match = re.search(pattern, param_name)
        if match:
            return int(match.group(1))
    raise ValueError(f"No expert number found in parameter name: {param_name}")


def _vocab_size(hf_config) -> int | None:
    """The first positive ``vocab_size`` in the config or its nested language-model configs."""
    pending, seen = [hf_config], set()
    while pending:
        config = pending.pop(0)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
        pending += [getattr(config, name, None) for name in _NESTED_CONFIGS]
    return None


class ExportSteps:
    """MegatronModelBridge inherits these; ``hf_config`` is the bridge's Hugging Face config."""

    hf_config = None

    @staticmethod
    def _is_vocab_export_task(task) -> bool:
        """A task that exports the token embedding or the output layer (rows = the vocabulary)."""
        if not task.global_param_name.removesuffix("_scale_inv").endswith(_VOCAB_PARAMS):
            return False
        hf_param = getattr(task.mapping, "hf_param", None)
        return isinstance(hf_param, str) and hf_param.endswith(_VOCAB_HF_PARAMS)

    def _truncate_vocab_padding(self, task, converted_weights_dict: dict, *, scale_block_size=None) -> dict:
        """The tensors with megatron's padding rows (past the Hugging Face vocabulary) dropped. A
        block-scale tensor (``*_scale_inv``) keeps one row per block of ``scale_block_size`` rows."""
        if not self._is_vocab_export_task(task):
            return converted_weights_dict
        is_scale = task.global_param_name.endswith("_scale_inv")
        key = task.mapping.hf_param + ("_scale_inv" if is_scale else "")
        vocab_size = _vocab_size(self.hf_config)
        if key not in converted_weights_dict or vocab_size is None:
            return converted_weights_dict
        if is_scale:
            scale_block_size = getattr(task.mapping, "scale_block_size", None)
            if scale_block_size is None:  # the block: the weight's rows per scale row, on this rank
                scale = task.param_weight
                weight = getattr(task.megatron_module, "weight", None)
                if scale is None or weight is None or scale.ndim == 0 or weight.ndim == 0:
                    return converted_weights_dict
                if not scale.shape[0] or not weight.shape[0] or weight.shape[0] % scale.shape[0]:
                    return converted_weights_dict
                scale_block_size = weight.shape[0] // scale.shape[0]
        target = math.ceil(vocab_size / scale_block_size) if scale_block_size else vocab_size
        padded = converted_weights_dict[key]
        if padded.ndim == 0 or padded.shape[0] <= target:
            return converted_weights_dict
        result = {}
        for name, tensor in converted_weights_dict.items():
            if tensor.ndim and scale_block_size and name.endswith("_scale_inv"):
                tensor = tensor[: math.ceil(vocab_size / scale_block_size)]
            elif tensor.ndim and tensor.shape[0] == padded.shape[0]:
                tensor = tensor[:vocab_size]
            result[name] = tensor
        return result

    @staticmethod
    def _cast_export_weight_dtype(weights: dict, weight_dtype) -> dict:
        """Floating-point tensors cast to ``weight_dtype`` (None: unchanged)."""
        if weight_dtype is None:
            return weights
        return {n: w.to(weight_dtype) if w.is_floating_point() else w for n, w in weights.items()}

    def _accumulate_grouped_export(
        self, task, converted_weights_dict: dict, model_config, grouped_buffers: dict, hf_state_dict
    ) -> dict | None:
        """Collect one expert's tensors under their fused Hugging Face names; when every expert of a
        name has come, give the stacked ``[num_experts, ...]`` tensor (None until then). Under expert
        parallelism a converted tensor may hold each EP rank's copy of this local expert (dim 0)."""
        ep_size = task.mapping.ep_size
        num_experts = model_config.num_moe_experts
        per_rank = num_experts // ep_size
        try:
            local = extract_expert_number_from_param(task.param_name) % per_rank
        except ValueError:
            return None
        merged = {}
        for key, value in converted_weights_dict.items():
            buffer = grouped_buffers.setdefault(key, {})
            if ep_size > 1 and value.ndim > 0 and value.shape[0] == ep_size:
                for ep_rank in range(ep_size):
                    buffer[local + ep_rank * per_rank] = value[ep_rank]
            else:
                buffer[local] = value
            if len(buffer) != num_experts:
                continue
            tensors = [buffer[i] for i in range(num_experts)]
            try:
                stacked = torch.stack(tensors, dim=0)
            except torch.OutOfMemoryError:
                if not any(getattr(t, "is_cuda", False) for t in tensors):
                    raise
                logger.warning(
                    "Grouped expert export ran out of CUDA memory stacking %d experts; retrying on CPU.",
                    num_experts,
                )
                tensors = [t.cpu() for t in tensors]
                grouped_buffers.pop(key, None)
                gc.collect()
                stacked = torch.stack(tensors, dim=0)
            if getattr(task.mapping, "transpose_on_export", False):
                transposed = stacked.transpose(-1, -2).contiguous()
                if key not in hf_state_dict:
                    stacked = transposed
                else:  # only where the source's shape says so
                    expected = tuple(hf_state_dict[key].shape)
                    if tuple(stacked.shape) != expected and tuple(transposed.shape) == expected:
                        stacked = transposed
            grouped_buffers.pop(key, None)
            merged[key] = stacked
        return merged or None

    def _get_tied_output_hf_name(self, task, mapping_registry) -> str | None:
        """The Hugging Face name of the output layer tied to this embedding task's weight, where it
        differs from the embedding's (None otherwise)."""
        suffix = "embedding.word_embeddings.weight"
        if not task.global_param_name.endswith(suffix):
            return None
        if not isinstance(task.mapping.hf_param, str):
            raise ValueError(
                f"Expected a tied embedding to map to one Hugging Face tensor: {task.mapping.hf_param!r}"
            )
        prefix = task.global_param_name[: -len(suffix)]
        output = mapping_registry.megatron_to_hf_lookup(f"{prefix}output_layer.weight")
        if output is None:
            return None
        if not isinstance(output.hf_param, str):
            raise ValueError(
                f"Expected a tied output layer to map to one Hugging Face tensor: {output.hf_param!r}"
            )
        return None if output.hf_param == task.mapping.hf_param else output.hf_param
