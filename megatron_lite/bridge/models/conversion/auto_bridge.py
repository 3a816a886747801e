"""AutoBridge: a Hugging Face model in and out of megatron_lite at any TP / PP layout, with
Megatron-Bridge's API (``megatron.bridge.AutoBridge``). Local directories only: nothing is downloaded,
no code from a model directory runs.

    bridge = AutoBridge.from_hf_pretrained("/models/Llama-3.1-8B")
    provider = bridge.to_megatron_provider()   # a GPTModelProvider from config.json; provide() loads
    chunks = [provider.provide()]              # this rank's stage, its weights read from the files
    bridge.save_hf_pretrained(chunks, "/out")   # collective: config, sharded safetensors, tokenizer
"""

from __future__ import annotations

import json
from functools import cached_property, partial
from pathlib import Path

import torch.distributed as dist

from megatron_lite.bridge.models.conversion import model_bridge
from megatron_lite.bridge.models.conversion.auto_bridge_adapters import AdapterExport
from megatron_lite.bridge.models.conversion.auto_bridge_checkpoints import MegatronCheckpoints
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.hf_config import UNSUPPORTED
from megatron_lite.bridge.models.hf_pretrained.architectures import (  # noqa: F401  (upstream's module names)
    HF_ARCHITECTURE_ALIASES,
    MTP_CONFIG_FIELDS,
    PRETRAINED_WRAPPER_TYPES,
    SUPPORTED_HF_ARCHITECTURES,
    SUPPORTED_HF_ARCHITECTURES_DISPLAY,
    _config_disables_mtp,
    _drop_readonly_config_properties,
    _model_omits_mtp,
    _mtp_source_key_prefixes,
    _resolve_pretrained_wrapper_cls,
    _saved_config_disables_mtp,
)
from megatron_lite.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM, _ConfigOnlyPretrainedShim
from megatron_lite.bridge.models.hf_pretrained.export_directory import write_hf_weights
from megatron_lite.bridge.models.hf_pretrained.masked_lm import PreTrainedMaskedLM
from megatron_lite.bridge.models.hf_pretrained.safe_config_loader import (
    JSONConfig,
    safe_load_config_with_retry,
)
from megatron_lite.bridge.models.hf_pretrained.state import SafeTensorsStateSource  # noqa: F401
from megatron_lite.bridge.models.hf_pretrained.token_classification import PreTrainedTokenClassification

try:  # the architecture classes dispatch by; without transformers, by their names
    import transformers
    from transformers.configuration_utils import PretrainedConfig

    _CONFIG_TYPES: tuple[type, ...] = (PretrainedConfig, JSONConfig)
except ImportError:
    transformers = None
    _CONFIG_TYPES = (JSONConfig,)

__all__ = ["AutoBridge", "PreTrainedCausalLM", "PreTrainedMaskedLM", "PreTrainedTokenClassification"]


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class AutoBridge(MegatronCheckpoints, AdapterExport):
    """A Hugging Face model (a ``PreTrainedCausalLM`` / ``PreTrainedMaskedLM`` /
    ``PreTrainedTokenClassification`` wrapper, or a config alone) and the family bridge that reads it."""

    def __init__(self, hf_pretrained):
        if not isinstance(hf_pretrained, (*PRETRAINED_WRAPPER_TYPES, *_CONFIG_TYPES)):
            raise ValueError(
                "hf_pretrained must be a PreTrainedCausalLM, PreTrainedMaskedLM, "
                "PreTrainedTokenClassification, or PretrainedConfig instance"
            )
        self.hf_pretrained = hf_pretrained
        self.export_weight_dtype = "bf16"
        self.hf_model_id: str | None = None
        init_kwargs = getattr(hf_pretrained, "init_kwargs", {})
        revision = init_kwargs.get("revision") if isinstance(init_kwargs, dict) else None
        self.hf_model_revision = revision if isinstance(revision, str) else None
        trust_remote_code = getattr(hf_pretrained, "trust_remote_code", False)
        self.trust_remote_code = trust_remote_code if isinstance(trust_remote_code, bool) else False

    # ---- which models ----
    @classmethod
    def list_supported_models(cls) -> list[str]:
        """The architecture names a bridge is registered for."""
        registry = getattr(model_bridge.get_model_bridge, "_exact_types", {})
        return sorted(k if isinstance(k, str) else getattr(k, "__name__", str(k)) for k in registry)

    @classmethod
    def supports(cls, config) -> bool:
        """Whether one of the config's architectures ends as AutoBridge's do (``ForCausalLM``, ...)."""
        architectures = getattr(config, "architectures", None) or []
        return any(arch.endswith(SUPPORTED_HF_ARCHITECTURES) for arch in architectures)

    @classmethod
    def _validate_config(cls, config, path: str | None = None) -> None:
        """ValueError unless the config names a supported architecture with a registered bridge."""
        architectures = getattr(config, "architectures", None) or []
        if not cls.supports(config):
            raise BridgeError(
                f"{path or 'config'}: Model architecture not supported by AutoBridge: {architectures} "
                f"(AutoBridge takes architectures ending in {SUPPORTED_HF_ARCHITECTURES_DISPLAY})"
            )
        architecture = next(a for a in architectures if a.endswith(SUPPORTED_HF_ARCHITECTURES))
        name = HF_ARCHITECTURE_ALIASES.get(architecture, architecture)
        registry = getattr(model_bridge.get_model_bridge, "_exact_types", {})
        if name not in registry and architecture not in registry:
            raise BridgeError(
                f"{path or 'config'}: Model architecture '{architecture}' is not yet supported; "
                f"megatron_lite imports {', '.join(cls.list_supported_models())}"
            )

    @staticmethod
    def _check_model_type(config) -> None:
        """megatron_lite's own refusal of a model_type it cannot build (one line naming the field)."""
        model_type = getattr(config, "model_type", None)
        if not isinstance(model_type, str):
            return
        if model_type in UNSUPPORTED:
            raise BridgeError(
                f"config.json: {UNSUPPORTED[model_type]} of model_type {model_type!r} is not supported by megatron_lite"
            )
        model_bridge.MegatronModelBridge.for_model_type(model_type)

    @classmethod
    def can_handle(cls, path, trust_remote_code: bool = False) -> bool:
        try:
            cls._validate_config(
                safe_load_config_with_retry(path, trust_remote_code=trust_remote_code), str(path)
            )
            return True
        except Exception:  # any reason the model cannot be read is a "no"
            return False

    # ---- construction ----
    @classmethod
    def from_hf_config(cls, config) -> AutoBridge:
        """A bridge of a config alone (no weights): providers for random initialisation, export."""
        cls._validate_config(config)
        return cls(config)

    @classmethod
    def from_hf_pretrained(cls, path, **kwargs) -> AutoBridge:
        """A bridge of the local model directory ``path``: reads config.json now, the weights when a
        model is loaded. ``kwargs`` go to the wrapper's ``from_pretrained``."""
        config_kwargs = dict(kwargs)
        trust_remote_code = bool(config_kwargs.pop("trust_remote_code", False))
        config = safe_load_config_with_retry(path, trust_remote_code=trust_remote_code, **config_kwargs)
        cls._validate_config(config, str(path))
        cls._check_model_type(config)
        wrapper_cls = _resolve_pretrained_wrapper_cls(config)
        try:
            hf_pretrained = wrapper_cls.from_pretrained(path, **kwargs)
            hf_pretrained.config = config  # the config validated above, not a second read
            return cls(hf_pretrained)
        except Exception as err:
            raise BridgeError(f"Failed to load model with AutoBridge: {err}") from err

    # ---- the family bridge and its input ----
    @property
    def _causal_lm_architecture(self):
        """The architecture the bridge is found by: transformers' class where it has one, else the name."""
        config = (
            self.hf_pretrained.config
            if isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES)
            else self.hf_pretrained
        )
        architectures = getattr(config, "architectures", None) or []
        if not architectures:
            raise BridgeError("No architectures found in model config (config.json's architectures)")
        found = [a for a in architectures if a.endswith(SUPPORTED_HF_ARCHITECTURES)]
        if not found:
            raise BridgeError(
                f"No supported architecture found: {architectures} (none ends with {SUPPORTED_HF_ARCHITECTURES_DISPLAY})"
            )
        auto_map = getattr(config, "auto_map", None)
        if isinstance(auto_map, dict) and "AutoModelForCausalLM" in auto_map:
            return str(auto_map["AutoModelForCausalLM"]).split(".")[-1]
        name = HF_ARCHITECTURE_ALIASES.get(found[0], found[0])
        return getattr(transformers, name, name) if transformers is not None else name

    @property
    def _model_bridge(self):
        hf_config = getattr(self.hf_pretrained, "hf_config", None)
        if hf_config is None:
            wrapped = isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES)
            hf_config = self.hf_pretrained.config if wrapped else self.hf_pretrained
        bridge = model_bridge.get_model_bridge(self._causal_lm_architecture, hf_config=hf_config)
        bridge.export_weight_dtype = self.export_weight_dtype
        return bridge

    @property
    def _pretrained_wrapper_cls(self) -> type:
        for wrapper in (PreTrainedTokenClassification, PreTrainedMaskedLM, PreTrainedCausalLM):
            if isinstance(self.hf_pretrained, wrapper):
                return wrapper
        return _resolve_pretrained_wrapper_cls(self.hf_pretrained)

    @cached_property
    def _config_only_pretrained(self) -> PreTrainedCausalLM:
        if not isinstance(self.hf_pretrained, _CONFIG_TYPES):
            raise ValueError(
                "Config-only shim accessed when hf_pretrained is not a PretrainedConfig instance."
            )
        return _ConfigOnlyPretrainedShim(self.hf_pretrained)

    @property
    def _provider_bridge_input(self):
        if isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES):
            return self.hf_pretrained
        return self._config_only_pretrained

    def _source(self, hf_path):
        """The wrapper weights are read from: ``hf_path``'s, else this bridge's."""
        if hf_path is None:
            if not isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES):
                raise ValueError(
                    "hf_path is required when hf_pretrained is not a PreTrainedCausalLM, PreTrainedMaskedLM, "
                    "or PreTrainedTokenClassification instance"
                )
            return self.hf_pretrained
        trust_remote_code = getattr(self.hf_pretrained, "trust_remote_code", False)
        return self._pretrained_wrapper_cls.from_pretrained(hf_path, trust_remote_code=trust_remote_code)

    # ---- Hugging Face -> megatron ----
    def to_megatron_provider(self, load_weights: bool = True, hf_path=None):
        """The provider (GPTModelProvider) of the config's architecture; with ``load_weights`` each
        model it provides is filled with this rank's shard of the weights (of ``hf_path`` when given)."""
        provider = self._model_bridge.provider_bridge(self._provider_bridge_input)
        if load_weights:
            if hf_path is None and not isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES):
                raise ValueError(
                    "AutoBridge.from_hf_config() does not include weights. Pass load_weights=False for "
                    "random initialization or provide hf_path to load weights."
                )
            provider.perform_initialization = False  # every weight is read from the files: no random init
            provider.register_pre_wrap_hook(
                partial(self._model_bridge.load_weights_hf_to_megatron, self._source(hf_path))
            )
        identifier = str(hf_path) if hf_path is not None else None
        if identifier is None:
            name = getattr(self.hf_pretrained, "model_name_or_path", None)
            if name is None and isinstance(self.hf_pretrained, _CONFIG_TYPES):
                name = getattr(self.hf_pretrained, "name_or_path", None)
            identifier = str(name) if name else None
        if identifier:
            provider.hf_model_id = identifier
        if hf_path is None and self.hf_model_revision:
            provider.hf_model_revision = self.hf_model_revision
        return provider

    def to_megatron_model(self, load_weights: bool = True, hf_path=None, **kwargs) -> list:
        """This rank's model chunks (``provide_distributed_model``'s keywords)."""
        provider = self.to_megatron_provider(load_weights, hf_path)
        if hasattr(provider, "finalize"):
            provider.finalize()
        return provider.provide_distributed_model(**kwargs)

    def load_hf_weights(
        self, model, hf_path=None, allowed_mismatched_params=None, show_progress: bool = False
    ):
        """Copy the Hugging Face weights into this rank's model chunks (each rank reads only its own
        shard, straight from the memory-mapped files). Not collective."""
        source = self._source(hf_path)
        extra = {"show_progress": True} if show_progress else {}  # megatron_lite's progress lines
        self._model_bridge.load_weights_hf_to_megatron(
            source, model, allowed_mismatched_params=allowed_mismatched_params, **extra
        )
        return model

    def _checkpoint(self, hf_path=None):
        """The safetensors files weights are read from (megatron_lite's reader, one slice at a time)."""
        from megatron_lite.bridge.models.hf_pretrained.safe_tensors import SafeTensorsCheckpoint

        source = self._source(hf_path)
        return SafeTensorsCheckpoint(str(source.model_name_or_path), self._model_bridge.optional_hf_prefix)

    # ---- megatron -> Hugging Face ----
    def export_hf_weights(
        self, model, cpu: bool = True, show_progress: bool = True, conversion_tasks=None,
        merge_adapter_weights: bool = True, weight_dtype=None,
    ):  # fmt: skip
        """(Hugging Face name, whole tensor) for every weight, on every rank. Collective over the TP
        and PP groups: every rank must consume the whole iterator."""
        yield from self._model_bridge.stream_weights_megatron_to_hf(
            model, self.hf_pretrained, cpu=cpu, show_progress=show_progress, conversion_tasks=conversion_tasks,
            merge_adapter_weights=merge_adapter_weights, weight_dtype=weight_dtype,
        )  # fmt: skip

    def save_hf_pretrained(
        self, model, path, show_progress: bool = True, source_path=None, strict: bool = True,
        merge_adapter_weights: bool = True, distributed_save: bool = False, save_every_n_ranks: int = 1,
        weight_dtype=None, max_shard_size: int | None = None,
    ) -> None:  # fmt: skip
        """Write a directory ``transformers`` loads: rank 0 saves config.json and the source's
        artifacts (tokenizer, generation config, processors), then every rank joins
        ``save_hf_weights``. Collective over the world."""
        if not isinstance(self.hf_pretrained, (*PRETRAINED_WRAPPER_TYPES, *_CONFIG_TYPES)):
            raise ValueError("save_hf_pretrained requires a pretrained HuggingFace model or config.")
        if _rank0():
            self._save_artifacts(path, source_path)
        extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        self.save_hf_weights(
            model, path, show_progress, strict, merge_adapter_weights=merge_adapter_weights,
            distributed_save=distributed_save, save_every_n_ranks=save_every_n_ranks, weight_dtype=weight_dtype,
            **extra,
        )  # fmt: skip

    def _save_artifacts(self, path, source_path) -> None:
        """config.json and the artifacts: the wrapper's, or for a config alone those of the model it
        was made from (``hf_model_id`` / ``source_path``) when known, else config.json only."""
        if isinstance(self.hf_pretrained, PRETRAINED_WRAPPER_TYPES):
            patterns = getattr(self._model_bridge, "ADDITIONAL_FILE_PATTERNS", None) or None
            self.hf_pretrained.save_artifacts(
                path, original_source_path=source_path, additional_files=patterns
            )
            return
        reference = self.hf_model_id or source_path
        if reference is not None:
            bridge = self._model_bridge
            kwargs = (
                dict(bridge.get_hf_tokenizer_kwargs() or {})
                if hasattr(bridge, "get_hf_tokenizer_kwargs")
                else {}
            )
            kwargs["trust_remote_code"] = self.trust_remote_code
            source = PreTrainedCausalLM.from_pretrained(reference, **kwargs)
            source.config = self.hf_pretrained
            patterns = getattr(bridge, "ADDITIONAL_FILE_PATTERNS", None) or None
            source.save_artifacts(path, original_source_path=source_path, additional_files=patterns)
            return
        Path(path).mkdir(parents=True, exist_ok=True)
        values = self.hf_pretrained.to_dict()
        if not self.trust_remote_code:
            values.pop("auto_map", None)  # it names code the directory does not carry
        with open(Path(path) / "config.json", "w") as f:
            json.dump(values, f, indent=2, sort_keys=True)

    def save_hf_weights(
        self, model, path, show_progress: bool = True, strict: bool = True, merge_adapter_weights: bool = True,
        distributed_save: bool = False, save_every_n_ranks: int = 1, weight_dtype=None,
        max_shard_size: int = 2 * 1024**3,
    ) -> None:  # fmt: skip
        """The weights alone, as safetensors files of at most ``max_shard_size`` bytes with their index,
        after checking the model is the one the config describes. Collective: every rank streams,
        rank 0 writes (``distributed_save`` is refused: one writer here)."""
        if distributed_save:
            raise BridgeError(
                "save_hf_weights(distributed_save=True) is not supported by megatron_lite: rank 0 writes"
            )
        write_hf_weights(self, model, path, show_progress, max_shard_size, weight_dtype=weight_dtype)

    def _get_model_instance(self, model):
        instance = model[0] if isinstance(model, list) else model
        while hasattr(instance, "module"):
            instance = instance.module
        return instance

    def __repr__(self) -> str:
        lines = []
        for label, part in (("hf_pretrained", self.hf_pretrained), ("model_bridge", self._model_bridge)):
            first, *rest = repr(part).splitlines() or [""]
            lines += [f"  ({label}): {first}", *(f"  {line}" for line in rest)]
        return f"{type(self).__name__}(\n" + "\n".join(lines) + "\n)"
