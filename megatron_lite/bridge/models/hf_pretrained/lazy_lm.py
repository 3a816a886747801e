"""What Megatron-Bridge's language-model wrappers (causal, masked, token classification) share: the
constructor, the tokenizer, device and dtype moves, encode / decode, save_pretrained and the repr.
Each wrapper names the ``transformers`` Auto class its model loads through."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_lite.bridge.models.hf_pretrained.base import PreTrainedBase


class LazyPreTrainedLM(PreTrainedBase):
    """A model directory whose config, tokenizer and model load on first use."""

    ARTIFACTS = ["tokenizer"]
    AUTO_MODEL_CLASS = "AutoModel"

    def __init__(
        self,
        model_name_or_path: str | Path | None = None,
        device: str | torch.device | None = None,
        torch_dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        **kwargs,
    ):
        self._model_name_or_path = model_name_or_path
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.torch_dtype = torch_dtype
        self.trust_remote_code = trust_remote_code
        super().__init__(**kwargs)

    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | Path,
        device: str | torch.device | None = None,
        torch_dtype: torch.dtype | None = None,
        trust_remote_code: bool = False,
        **kwargs,
    ):
        """A wrapper of the local directory ``model_name_or_path``; nothing is read yet."""
        return cls(
            model_name_or_path=model_name_or_path,
            device=device,
            torch_dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )

    def _load_model(self):
        return self._load_auto_model(self.AUTO_MODEL_CLASS)

    def _load_config(self):
        return self._load_config_from_path()

    @property
    def model_name_or_path(self) -> str | Path | None:
        return self._model_name_or_path

    @property
    def has_model(self) -> bool:
        return getattr(self, "_model", None) is not None

    @property
    def model(self):
        return super().model

    @model.setter
    def model(self, value):
        self._model = value.to(self.device) if value is not None else None

    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, value):
        self._tokenizer = value

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def encode(self, text, **kwargs) -> dict:
        """Token ids (and masks) of ``text`` as tensors on the wrapper's device."""
        kwargs.setdefault("return_tensors", "pt")
        return self.tokenizer(text, **kwargs).to(self.device)

    def decode(self, token_ids, **kwargs) -> str:
        return self.tokenizer.decode(token_ids, **kwargs)

    def to(self, device):
        self.device = device
        if self.has_model:
            self._model = self._model.to(device)
        return self

    def half(self):
        if self.has_model:
            self._model = self._model.half()
        return self

    def float(self):
        if self.has_model:
            self._model = self._model.float()
        return self

    def save_pretrained(self, save_directory) -> None:
        """The loaded model (if any), config.json and the artifacts."""
        save_path = Path(save_directory)
        save_path.mkdir(parents=True, exist_ok=True)
        if self.has_model:
            self._model.save_pretrained(save_path)
        self.save_artifacts(save_path)

    @property
    def dtype(self) -> torch.dtype | None:
        if self.has_model:
            return next(iter(self._model.parameters()), torch.empty(0)).dtype
        return None

    @property
    def num_parameters(self) -> int | None:
        return sum(p.numel() for p in self._model.parameters()) if self.has_model else None

    def __repr__(self) -> str:
        config = getattr(self, "_config", None)
        lines = []
        for name, attr in sorted(self.get_artifacts().items()):
            artifact = getattr(self, attr, None)
            state = (
                "not loaded" if artifact is None else f"vocab_size={getattr(artifact, 'vocab_size', 'N/A')}"
            )
            lines.append(
                f"  ({name}): {type(artifact).__name__ if artifact is not None else 'N/A'} [{state}]"
            )
        sizes = ", ".join(
            f"{label}={getattr(config, key)}"
            for label, key in (("layers", "num_hidden_layers"), ("hidden_size", "hidden_size"))
            if getattr(config, key, None) is not None
        )
        if self.has_model:
            model = f"{type(self._model).__name__} [{sizes + ', ' if sizes else ''}loaded]"
        elif config is not None:
            name = (getattr(config, "architectures", None) or [self.AUTO_MODEL_CLASS])[0]
            model = f"{name}({sizes}) [not loaded]" if sizes else f"{name} [not loaded]"
        else:
            model = f"{self.AUTO_MODEL_CLASS} [not loaded]"
        lines.append(f"  (model): {model}")
        lines.sort()
        params = f"{self.num_parameters:,}" if self.num_parameters is not None else "N/A"
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "N/A"
        lines += [f"  (parameters): {params}", f"  (device): {self.device}", f"  (dtype): {dtype}", ")"]
        return "\n".join([f"{type(self).__name__}(", *lines])


class ProcessorArtifacts:
    """A vision-language directory's processors, each read on first use (a ``_load_optional`` class's
    mixin: the causal and token-classification wrappers)."""

    def _load_processor(self):
        return self._load_optional("AutoProcessor")

    def _load_image_processor(self):
        processor = getattr(self, "_processor", None)
        if processor is not None and hasattr(processor, "image_processor"):
            return processor.image_processor
        return self._load_optional("AutoImageProcessor")

    @property
    def processor(self):
        if not hasattr(self, "_processor"):
            self._processor = self._load_processor()
        return self._processor

    @processor.setter
    def processor(self, value):
        self._processor = value

    @property
    def image_processor(self):
        if not hasattr(self, "_image_processor"):
            self._image_processor = self._load_image_processor()
        return self._image_processor

    @image_processor.setter
    def image_processor(self, value):
        self._image_processor = value
