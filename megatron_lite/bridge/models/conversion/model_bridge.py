"""MegatronModelBridge: one model family's config translation and weight mappings, and the two weight
streams every family shares (Hugging Face -> this rank's shards, all ranks' shards -> Hugging Face),
under Megatron-Bridge's names and signatures.

Import reads each rank's TP shard straight from the files (``read_shard``): no rank holds a tensor it
does not need; a LoRA-wrapped layer reads its base's weights (peft_bridge.py exports the adapters,
or folds them in on export). Export builds one WeightConversionTask per parameter of the whole model, in the same
order on every rank, and runs Megatron-Bridge's loop over them: convert (gather), let the family
adjust, drop the vocabulary padding, stack fused experts, write a tied output layer's second name,
then the task's export hook and the move to the CPU.
"""

from __future__ import annotations

import fnmatch

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.conversion import bridge_registry, experts, peft_bridge
from megatron_lite.bridge.models.conversion.bridge_registry import get_model_bridge
from megatron_lite.bridge.models.conversion.config_bridge import ConfigBridge, make_vocab_size_divisible_by
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.export_gather import (
    WholeTensorExport,
    export_order,
    layer_offset,
    model_groups,
    named_global_parameters,
    owners_over_stages,
    stage_parameters,
)
from megatron_lite.bridge.models.conversion.export_steps import ExportSteps
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.bridge.models.conversion.utils import unwrap_model
from megatron_lite.bridge.models.conversion.weight_tuples import (
    HFWeightTuple,
    MegatronWeightTuple,
    WeightConversionTask,
)
from megatron_lite.core import parallel_state
from megatron_lite.core.models.gpt.state_dict_sharding import global_name

__all__ = [
    "HFWeightTuple",
    "MegatronModelBridge",
    "MegatronWeightTuple",
    "WeightConversionTask",
    "get_model_bridge",
    "make_vocab_size_divisible_by",
]


def _get_pg_collection_from_model(megatron_model):
    """The ProcessGroupCollection the (first) model chunk was built with; None for none."""
    if megatron_model is None:
        return None
    models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
    if not models:
        return None
    chunk = unwrap_model(models[0])
    chunk = getattr(chunk, "language_model", None) or chunk
    return getattr(chunk, "pg_collection", None)


def _get_pp_group(megatron_model):
    pg = _get_pg_collection_from_model(megatron_model)
    group = getattr(pg, "pp", None) if pg is not None else None
    return group if group is not None else parallel_state.get_pipeline_model_parallel_group()


def _get_pp_rank(megatron_model) -> int:
    return dist.get_rank(_get_pp_group(megatron_model))


def _get_ep_group(megatron_model):
    pg = _get_pg_collection_from_model(megatron_model)
    if pg is not None:
        return getattr(pg, "ep", None)
    return parallel_state.get_expert_model_parallel_group(check_initialized=False)


def _megatron_local_name_to_global(models, config, param_name: str, vp_stage: int | None = None) -> str:
    """A chunk's parameter name with its layer number and expert index made the whole model's."""
    models = models if isinstance(models, list) else [models]
    chunk = unwrap_model(models[vp_stage or 0])
    for prefix, module in chunk.named_modules():
        if hasattr(module, "local_expert_offset") and param_name.startswith(prefix + "."):
            rest = experts.local_to_global(param_name[len(prefix) + 1 :], module.local_expert_offset)
            param_name = f"{prefix}.{rest}"
            break
    return global_name(param_name, layer_offset(chunk))


def _is_pretrained_config(obj) -> bool:
    return any(cls.__name__ == "PretrainedConfig" for cls in type(obj).__mro__)


class MegatronModelBridge(ConfigBridge, ExportSteps, peft_bridge.MegatronPeftBridge):
    """A family subclasses it, registers with ``@MegatronModelBridge.register_bridge(source=...,
    target=..., model_type=...)`` and gives ``mapping_registry()`` and its config fields."""

    # Tensors a directory may hold that are no weights of ours (buffers some versions saved).
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    optional_hf_prefix: str = ""
    SUPPORTS_HF_PRETRAINED_EXPORT = True
    ADDITIONAL_FILE_PATTERNS = None

    @classmethod
    def register_bridge(cls, *, source, target, provider=None, model_type: str | None = None):
        """Class decorator: the bridge of Hugging Face architecture ``source`` (a class or its name) to
        the megatron model class ``target``, found by ``get_model_bridge`` and by ``model_type``."""
        return lambda bridge_class: bridge_registry.register(
            bridge_class, source, target, provider, model_type
        )

    @staticmethod
    def for_model_type(model_type: str | None) -> type[MegatronModelBridge]:
        return bridge_registry.for_model_type(model_type)

    @staticmethod
    def supported_model_types() -> list[str]:
        return bridge_registry.supported_model_types()

    def mapping_registry(self) -> MegatronMappingRegistry:
        raise NotImplementedError("Subclass must implement mapping_registry method")

    # ---- hooks a family may override ----
    def maybe_modify_loaded_hf_weight(self, hf_param, hf_state_dict):
        """The Hugging Face tensor(s) a mapping reads (a family may rename or dequantize)."""
        if isinstance(hf_param, str):
            return hf_state_dict[hf_param]
        return {role: hf_state_dict[name] for role, name in hf_param.items()}

    def maybe_modify_converted_hf_weight(self, task, converted_weights_dict, hf_state_dict):
        """The exported tensors of one task (a family may add or rename some)."""
        return converted_weights_dict

    def _share_embeddings_and_output_weights(self, model_config) -> bool:
        return getattr(model_config, "share_embeddings_and_output_weights", False)

    def _unwrap_name(self, name: str) -> str:
        if not isinstance(name, str):
            raise ValueError(f"name must be a string, got {type(name)}")
        while name.startswith("module."):
            name = name[len("module.") :]
        return name

    def _with_progress_tracking(self, tasks, description: str, show_progress: bool = True):
        """The tasks, one by one; with ``show_progress`` rank 0 prints each one's name."""
        main = not dist.is_initialized() or dist.get_rank() == 0
        for number, task in enumerate(tasks, start=1):
            yield task
            if show_progress and main:
                print(f" {description}: {task.global_param_name} ({number}/{len(tasks)})", flush=True)

    # ---- Hugging Face -> megatron ----
    def _checkpoint(self, hf_pretrained):
        """The files to read: megatron_lite's checkpoint reader as it is, else the model's directory."""
        if hasattr(hf_pretrained, "read") and hasattr(hf_pretrained, "names"):
            return hf_pretrained
        from megatron_lite.bridge.models.hf_pretrained.safe_tensors import SafeTensorsCheckpoint

        path = getattr(hf_pretrained, "model_name_or_path", hf_pretrained)
        return SafeTensorsCheckpoint(str(path), self.optional_hf_prefix)

    def load_weights_hf_to_megatron(
        self, hf_pretrained, megatron_model, allowed_mismatched_params=None, show_progress: bool = False
    ):
        """Fill every parameter of this rank's chunks with its TP shard, read straight from the files;
        a parameter matching a pattern of ``allowed_mismatched_params`` whose shapes differ keeps its
        values. Not collective: each rank reads its own layers only. Returns ``megatron_model``."""
        allowed = list(allowed_mismatched_params or ())
        checkpoint = self._checkpoint(hf_pretrained)
        chunks = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
        config = chunks[0].config
        registry = self.mapping_registry()
        tied = self._share_embeddings_and_output_weights(config)
        unknown = checkpoint.names() - registry.hf_names(config)
        if tied:
            unknown.discard("lm_head.weight")  # some tied models' files carry the tied copy too
        unknown = sorted(n for n in unknown if not n.endswith(self.ignored_hf_suffixes))
        if unknown:
            raise BridgeError(
                f"{checkpoint.path}: tensor {unknown[0]} ({len(unknown)} in all) has no place in a "
                f"megatron_lite {self.MODEL_TYPE} model"
            )
        for chunk in chunks:
            tp_group, _, expt_tp_group, _ = model_groups(chunk)
            with torch.no_grad():
                for full_name, param in named_global_parameters(chunk):
                    if self._is_adapter_param_name(full_name):
                        continue  # a LoRA adapter's own weights: no tensor of the base model's files
                    full_name = self._get_lora_unwrapped_name(full_name)  # a LoRA-wrapped layer's base
                    # A routed expert splits over the expert-TP ranks, everything else over TP.
                    group = expt_tp_group if experts.is_expert_param(full_name) else tp_group
                    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
                    # A tied output layer holds the embedding's weight.
                    source = (
                        "embedding.word_embeddings.weight"
                        if tied and full_name == "output_layer.weight"
                        else full_name
                    )
                    mapping = registry.megatron_to_hf_lookup(source)
                    if mapping is None:
                        raise BridgeError(f"no Hugging Face tensor maps to {full_name}")
                    try:
                        shard = mapping.read_shard(
                            checkpoint.read, tuple(param.shape), tp_rank, tp_size, config
                        )
                    except RuntimeError:  # a tensor whose size cannot make this parameter (reshaped)
                        shard = None
                    if shard is None or tuple(shard.shape) != tuple(param.shape):
                        if any(fnmatch.fnmatch(full_name, pattern) for pattern in allowed):
                            continue
                        shapes = ", ".join(
                            f"{n} {tuple(checkpoint.shape(n))}" for n in mapping.hf_param_names
                        )
                        raise BridgeError(
                            f"{checkpoint.path}: {shapes} do not make {full_name}'s TP shard "
                            f"{tuple(param.shape)} (tp {tp_size}); the weights do not fit config.json"
                        )
                    param.copy_(shard)
                    if show_progress and dist.get_rank() == 0:
                        print(f" loaded {full_name} {tuple(param.shape)}", flush=True)
        return megatron_model

    # ---- megatron -> Hugging Face ----
    def _megatron_global_param_names_all_pp_ranks(self, megatron_model) -> list[str]:
        """Every parameter's whole-model name over all pipeline stages, in export order (collective
        over PP)."""
        chunks = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
        entries = stage_parameters(chunks, chunks[0].config)
        return sorted(owners_over_stages(entries, model_groups(chunks[0])[1]), key=export_order)

    def build_conversion_tasks(
        self, hf_pretrained, megatron_model, weight_dtype=None, merge_adapter_weights: bool = True
    ) -> list:
        """One export task per parameter of the whole model, the same list on every rank (collective
        over PP). Refused (BridgeError) at expert parallel size > 1: each rank holds some experts only.
        A LoRA-wrapped layer exports its base weight, with ``merge_adapter_weights`` the adapter
        folded in; the adapters alone export through ``save_hf_adapter``."""
        chunks = unwrap_model(megatron_model if isinstance(megatron_model, list) else [megatron_model])
        config = chunks[0].config
        if hf_pretrained is not None:
            self.hf_config = hf_pretrained.config if hasattr(hf_pretrained, "config") else hf_pretrained
        tp_group, pp_group, expt_tp_group, ep_group = model_groups(chunks[0])
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            raise BridgeError(
                "export at expert_model_parallel_size > 1 is not supported: each rank holds some experts "
                "only; export from a checkpoint loaded at expert parallel size 1"
            )
        registry = self.mapping_registry()
        entries = stage_parameters(chunks, config)
        owners = owners_over_stages(entries, pp_group)
        scales = peft_bridge.adapter_scales(chunks, pp_group) if merge_adapter_weights else {}
        # NCCL moves device tensors only: the shapes and received tensors live where the weights do.
        device = next(chunks[0].parameters()).device
        wrappers = peft_bridge.stage_wrappers(chunks)
        tasks = []
        for raw in sorted((n for n in owners if not self._is_adapter_param_name(n)), key=export_order):
            name = self._get_lora_unwrapped_name(raw)  # a LoRA-wrapped layer's base weight
            mapping = registry.megatron_to_hf_lookup(name)
            if mapping is None:
                raise BridgeError(f"{name} has no Hugging Face name in a {self.MODEL_TYPE} model")
            param, vp_stage, chunk = entries.get(raw, (None, None, None))
            export = WholeTensorExport(
                mapping, name, owners[raw], (tp_group, pp_group, expt_tp_group), config, device
            )
            if ".to_wrap.weight" in raw and merge_adapter_weights:  # biases are not adapted
                prefix = raw.split(".to_wrap.")[0]
                export = peft_bridge.MergedLoRAExport(
                    export, prefix, owners, wrappers.get(prefix), scales[prefix]
                )
            tasks.append(
                WeightConversionTask(
                    param_name=name,
                    global_param_name=name,
                    mapping=export,
                    pp_rank=owners[raw][0],
                    vp_stage=vp_stage,
                    megatron_module=chunk,
                    param_weight=param,
                    weight_dtype=weight_dtype,
                )
            )
        return tasks

    def stream_weights_megatron_to_hf(
        self,
        megatron_model,
        hf_pretrained=None,
        cpu: bool = True,
        show_progress: bool | None = None,
        conversion_tasks: list | None = None,
        merge_adapter_weights: bool = True,
        weight_dtype=None,
    ):
        """HFWeightTuple (name, whole tensor) for every weight, on every rank, in layer order.
        Collective over each rank's TP, expert-TP and PP groups, task by task: every rank must consume
        the whole iterator. ``hf_pretrained`` is the source model (its config, and its file's names for
        a tied output layer's second name) or a config."""
        models = megatron_model if isinstance(megatron_model, list) else [megatron_model]
        chunks = unwrap_model(models)
        self.hf_pretrained = hf_pretrained
        self.hf_config = hf_pretrained.config if hasattr(hf_pretrained, "config") else hf_pretrained
        if conversion_tasks is None:
            conversion_tasks = self.build_conversion_tasks(
                hf_pretrained, chunks, weight_dtype=weight_dtype, merge_adapter_weights=merge_adapter_weights
            )
        elif weight_dtype is not None:
            raise ValueError("weight_dtype is not supported with caller-supplied conversion_tasks")
        model_config = chunks[0].config
        tied = self._share_embeddings_and_output_weights(model_config)
        tied_registry = self.mapping_registry() if tied else None
        hf_state_dict = hf_pretrained.state if hasattr(hf_pretrained, "state") else {}
        grouped_buffers: dict = {}
        for task in self._with_progress_tracking(
            conversion_tasks, "Converting to HuggingFace", bool(show_progress)
        ):
            converted = task.mapping.megatron_to_hf(task.param_weight, task.megatron_module)
            if getattr(task.mapping, "is_grouped_export", False):
                # One expert of a fused Hugging Face tensor: written once every expert has come.
                merged = self._accumulate_grouped_export(
                    task, converted, model_config, grouped_buffers, hf_state_dict
                )
                for hf_name, tensor in self._cast_export_weight_dtype(
                    merged or {}, task.weight_dtype
                ).items():
                    yield from HFWeightTuple(hf_name, tensor).iter_finalized(
                        cpu=cpu, export_hook=task.export_hook
                    )
                continue
            converted = self.maybe_modify_converted_hf_weight(task, converted, hf_state_dict)
            converted = self._truncate_vocab_padding(task, converted)
            converted = self._cast_export_weight_dtype(converted, task.weight_dtype)
            tied_name = (
                self._get_tied_output_hf_name(task, tied_registry) if tied_registry is not None else None
            )
            for hf_name, tensor in converted.items():
                tied_embedding = tied_name is not None and hf_name == task.mapping.hf_param
                if not tied_embedding and tied:
                    if task.global_param_name.endswith("output_layer.weight") or hf_name == tied_name:
                        raise ValueError(f"Encountered {hf_name} when embeddings are tied: a mapping error.")
                yield from HFWeightTuple(hf_name, tensor).iter_finalized(
                    cpu=cpu, export_hook=task.export_hook
                )
                if tied_embedding and self._source_has(hf_pretrained, tied_name):
                    # The output layer's own name, on a copy of its own (a hook's identity output too).
                    yield from HFWeightTuple(tied_name, tensor).iter_finalized(
                        cpu=cpu, export_hook=task.export_hook, clone_identity_output=True
                    )

    @staticmethod
    def _source_has(hf_pretrained, hf_name: str) -> bool:
        """Whether a tied output layer's own name is written: where the source's files hold it (a
        config alone, written as transformers would, always)."""
        source = getattr(getattr(hf_pretrained, "state", None), "source", None)
        if source is not None:
            return hf_name in source.get_all_keys()
        return _is_pretrained_config(hf_pretrained)
