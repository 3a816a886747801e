"""Megatron-Bridge's ``PreTrainedBase``: a Hugging Face model directory whose parts (config, tokenizer,
model, tensors) are each read on first use. megatron_lite reads local directories only, runs no code
from them (no ``trust_remote_code``, no pickled weights), and needs ``transformers`` only for the
parts that are ``transformers`` objects (the model, the tokenizer); config.json and the tensors are
read without it.
"""

from __future__ import annotations

import shutil
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

from megatron_lite.bridge.models.hf_pretrained.safe_config_loader import (
    REMOTE_CODE_REFUSED,
    local_model_dir,
    safe_load_config_with_retry,
)
from megatron_lite.bridge.models.hf_pretrained.state import SafeTensorsStateSource, StateDict

# Artifacts that, when not loaded, are saved by copying the source's files as they are.
_COPIED_ARTIFACTS = {
    "tokenizer": [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "chat_template.jinja",
    ],
    "generation_config": ["generation_config.json"],
}


def transformers_auto(name: str):
    """``transformers.<name>`` (an Auto class); an ImportError naming what needs it otherwise."""
    try:
        import transformers
    except ImportError:
        raise ImportError(f"{name} needs the transformers package (pip install transformers)") from None
    return getattr(transformers, name)


def local_pretrained_kwargs(path, trust_remote_code: bool, kwargs: dict) -> dict:
    """The keywords every ``from_pretrained`` call here gets: local files only, no code, safetensors
    weights only (a ``.bin`` file is a pickle)."""
    if trust_remote_code:
        raise ValueError(REMOTE_CODE_REFUSED)
    local_model_dir(path)
    return {**kwargs, "trust_remote_code": False, "local_files_only": True}


class PreTrainedBase(ABC):
    """Lazily loaded ``config`` / ``model`` / ``state`` and the artifacts named in ``ARTIFACTS``
    (required) and ``OPTIONAL_ARTIFACTS``, each saved by ``save_artifacts``."""

    model_name_or_path: str | Path | None
    ARTIFACTS: ClassVar[list[str]] = []
    OPTIONAL_ARTIFACTS: ClassVar[list[str]] = []

    def __init__(self, **kwargs):
        self._state_dict_accessor: StateDict | None = None
        self.init_kwargs = kwargs
        # What save_artifacts copies from a remote-code source: never used here (no remote code).
        self.custom_file_patterns = ["*.py"]

    def get_artifacts(self) -> dict[str, str]:
        return {artifact: f"_{artifact}" for artifact in self.ARTIFACTS}

    def _copy_custom_modeling_files(
        self, source_path, target_path, file_patterns=None, revision=None
    ) -> list[str]:
        """Copy the files of ``source_path`` (a local directory) matching ``file_patterns`` (names or
        globs) into ``target_path``; returns the names copied. Nothing is downloaded."""
        source, target = Path(source_path), Path(target_path)
        copied = []
        if source.is_dir():
            for pattern in file_patterns if file_patterns is not None else self.custom_file_patterns:
                for file in source.glob(pattern):
                    if file.is_file():
                        try:
                            shutil.copy2(file, target / file.name)
                            copied.append(file.name)
                        except OSError:
                            pass  # as upstream: a file that cannot be copied is skipped
        return copied

    def save_artifacts(self, save_directory, original_source_path=None, additional_files=None) -> None:
        """Save config.json and every loaded artifact with a ``save_pretrained`` (not the model), then
        copy ``additional_files`` (names or globs) from the source directory."""
        save_path = Path(save_directory)
        save_path.mkdir(parents=True, exist_ok=True)
        config = self.config
        if config is not None:
            if hasattr(config, "quantization_config"):
                del config.quantization_config  # a quantized export is not supported (as upstream)
            missing = object()
            auto_map = vars(config).get("auto_map", missing)
            strip = auto_map is not missing and getattr(self, "trust_remote_code", False) is not True
            if strip:  # it names code the saved directory will not carry
                delattr(config, "auto_map")
            try:
                config.save_pretrained(save_path)
            finally:
                if strip:
                    config.auto_map = auto_map
        source = original_source_path or self.model_name_or_path
        for name in self.ARTIFACTS:
            if getattr(self, f"_{name}", None) is None and name in _COPIED_ARTIFACTS:
                # Not loaded: the source's files as they are (no transformers, no code), if it has any.
                self._copy_custom_modeling_files(source, save_path, _COPIED_ARTIFACTS[name])
                continue
            artifact = getattr(self, name)
            if artifact is not None and hasattr(artifact, "save_pretrained"):
                artifact.save_pretrained(save_path)
        for name in self.OPTIONAL_ARTIFACTS:
            if getattr(self, f"_{name}", None) is None and name in _COPIED_ARTIFACTS:
                self._copy_custom_modeling_files(source, save_path, _COPIED_ARTIFACTS[name])
                continue
            artifact = getattr(self, name, None)
            if artifact is not None and hasattr(artifact, "save_pretrained"):
                try:
                    artifact.save_pretrained(save_path)
                except ValueError:
                    # transformers refuses some hub generation configs; keep the source's file then.
                    if name != "generation_config" or source is None:
                        raise
                    if not self._copy_custom_modeling_files(source, save_path, ["generation_config.json"]):
                        raise
        if additional_files:
            self._copy_custom_modeling_files(
                original_source_path or self.model_name_or_path, save_path, additional_files
            )

    @abstractmethod
    def _load_model(self): ...

    @abstractmethod
    def _load_config(self): ...

    @property
    def model(self):
        if not hasattr(self, "_model"):
            self._model = self._load_model()
        return self._model

    @model.setter
    def model(self, value):
        self._model = value

    @property
    def config(self):
        if not hasattr(self, "_config"):
            self._config = self._load_config()
        return self._config

    @config.setter
    def config(self, value):
        self._config = value

    @property
    def state(self) -> StateDict:
        """The tensors by name: the loaded model's ``state_dict()``, else the directory's files."""
        if self._state_dict_accessor is None:
            if getattr(self, "_model", None) is not None:
                source = self._model.state_dict()
            elif getattr(self, "model_name_or_path", None):
                source = SafeTensorsStateSource(self.model_name_or_path)
            else:
                raise ValueError(
                    "Cannot create StateDict accessor: model is not loaded and model_name_or_path is not set."
                )
            self._state_dict_accessor = StateDict(source)
        return self._state_dict_accessor

    # -- loaders shared by the LM wrappers: config.json and the tokenizer, local files only --
    def _load_config_from_path(self):
        if self.model_name_or_path is None:
            raise ValueError("model_name_or_path must be provided to load config")
        return safe_load_config_with_retry(
            self.model_name_or_path, trust_remote_code=getattr(self, "trust_remote_code", False)
        )

    def _load_tokenizer(self):
        if self.model_name_or_path is None:
            raise ValueError("model_name_or_path must be provided to load tokenizer")
        kwargs = local_pretrained_kwargs(self.model_name_or_path, self.trust_remote_code, self.init_kwargs)
        tokenizer = transformers_auto("AutoTokenizer").from_pretrained(self.model_name_or_path, **kwargs)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _load_auto_model(self, auto_class):
        """The model through ``auto_class`` (``transformers``' Auto class, or its name), from the
        directory's safetensors only."""
        if self.model_name_or_path is None:
            raise ValueError("model_name_or_path must be provided to load model")
        kwargs = local_pretrained_kwargs(self.model_name_or_path, self.trust_remote_code, self.init_kwargs)
        kwargs["use_safetensors"] = True
        if self.torch_dtype is not None:
            kwargs["torch_dtype"] = self.torch_dtype
        if getattr(self, "_config", None) is not None:
            kwargs["config"] = self._config
        auto = transformers_auto(auto_class) if isinstance(auto_class, str) else auto_class
        return auto.from_pretrained(self.model_name_or_path, **kwargs).to(self.device)

    def _load_optional(self, auto_class: str):
        """An optional artifact (processor, generation config): None where the directory has none."""
        if self.model_name_or_path is None:
            return None
        try:
            kwargs = local_pretrained_kwargs(
                self.model_name_or_path, self.trust_remote_code, self.init_kwargs
            )
            return transformers_auto(auto_class).from_pretrained(self.model_name_or_path, **kwargs)
        except Exception:  # as upstream: not every model has one, and transformers' errors vary
            return None
