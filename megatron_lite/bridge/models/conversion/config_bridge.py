"""The config half of MegatronModelBridge (Megatron-Bridge's names and rules): a Hugging Face config to
GPTModelProvider fields through ``CONFIG_MAPPING`` and back, activations by name, dtypes.

A config is read as attributes (a transformers ``PretrainedConfig``, or config.json's dict seen through
HFConfig with the family's ``hf_config_defaults``), so the same mapping serves both. A family bridge
adds its fields in ``hf_config_to_model_config_kwargs`` and refuses what megatron_lite cannot build in
``check_hf_config``: ``provider_bridge`` runs both and turns any failure into one BridgeError line.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.hf_config import HFConfig
from megatron_lite.bridge.models.conversion.transformers_compat import rope_theta_from_hf
from megatron_lite.bridge.models.gpt.model_config import BridgeGPTModelConfig
from megatron_lite.core.activations import openai_gelu, squared_relu
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.models.gpt_provider import GPTModelProvider

# Hugging Face's ``hidden_act`` names; the first name of a function is the one written back.
ACTIVATION_FUNC_MAP: dict[str, Any] = {
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
    "sigmoid": F.sigmoid,
    "tanh": torch.tanh,
    "relu2": squared_relu,
    "squared_relu": squared_relu,
    "gelu_new": openai_gelu,
}

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "16-mixed": torch.float16,
}


def make_vocab_size_divisible_by(vocab_size: int) -> int:
    """The largest power of two up to 128 dividing the vocabulary (Megatron-Bridge's rule): at TP 1 the
    model gets no padding rows, whose logits would otherwise join the softmax."""
    divisor = 128
    while vocab_size % divisor:
        divisor //= 2
    return divisor


def _shape_checked(kwargs: dict) -> dict:
    heads = kwargs["num_attention_heads"]
    groups = kwargs.get("num_query_groups") or heads
    sizes = [kwargs["num_layers"], kwargs["hidden_size"], heads, groups]
    if kwargs.get("kv_channels") is not None:
        sizes.append(kwargs["kv_channels"])
    if min(sizes) < 1:
        raise BridgeError("config.json: layers, hidden size, heads and head size must be positive")
    if heads % groups:
        raise BridgeError(f"config.json: {heads} attention heads do not split into {groups} key-value heads")
    return kwargs


class ConfigBridge:
    """Config translation, both ways; MegatronModelBridge inherits it."""

    # Set by register_bridge: the Hugging Face architecture and config.json's model_type.
    SOURCE_NAME: ClassVar[str | None] = None
    MODEL_TYPE: ClassVar[str | None] = None
    # The provider class provider_bridge builds (None: GPTModelProvider).
    PROVIDER_CLASS: ClassVar[type | None] = None
    # The config hf_config_to_model_config builds: the outer class and its nested transformer's.
    MODEL_CONFIG_CLASS: ClassVar[type | None] = BridgeGPTModelConfig
    TRANSFORMER_CONFIG_CLASS: ClassVar[type] = TransformerConfig
    # transformers' class defaults of the family, for keys a config.json leaves out.
    hf_config_defaults: ClassVar[dict] = {}
    # The Hugging Face config last converted (provider_bridge, the weight streams), as upstream keeps.
    hf_config = None

    # (Hugging Face name, megatron name): read where the config has the field, written back where the
    # provider has it. Names of features megatron_lite lacks are listed so configs port; the family
    # bridges refuse those features.
    CONFIG_MAPPING: ClassVar[list[tuple[str, str]]] = [
        ("num_hidden_layers", "num_layers"),
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "ffn_hidden_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("num_key_value_heads", "num_query_groups"),
        ("head_dim", "kv_channels"),
        ("vocab_size", "vocab_size"),
        ("max_position_embeddings", "seq_length"),
        ("rms_norm_eps", "layernorm_epsilon"),
        ("initializer_range", "init_method_std"),
        ("attention_dropout", "attention_dropout"),
        ("hidden_dropout", "hidden_dropout"),
        ("tie_word_embeddings", "share_embeddings_and_output_weights"),
        ("attention_bias", "add_qkv_bias"),
        ("mlp_bias", "add_bias_linear"),
        ("use_qk_norm", "qk_layernorm"),
        ("rope_theta", "rotary_base"),
        ("partial_rotary_factor", "rotary_percent"),
        ("num_experts", "num_moe_experts"),
        ("num_local_experts", "num_moe_experts"),
        ("num_experts_per_tok", "moe_router_topk"),
        ("moe_intermediate_size", "moe_ffn_hidden_size"),
        ("aux_loss_alpha", "moe_aux_loss_coeff"),
        ("router_aux_loss_coef", "moe_aux_loss_coeff"),
        ("scoring_func", "moe_router_score_function"),
        ("n_routed_experts", "num_moe_experts"),
        ("n_group", "moe_router_num_groups"),
        ("topk_group", "moe_router_group_topk"),
        ("routed_scaling_factor", "moe_router_topk_scaling_factor"),
        ("q_lora_rank", "q_lora_rank"),
        ("kv_lora_rank", "kv_lora_rank"),
        ("qk_nope_head_dim", "qk_head_dim"),
        ("qk_rope_head_dim", "qk_pos_emb_head_dim"),
        ("v_head_dim", "v_head_dim"),
        ("num_nextn_predict_layers", "mtp_num_layers"),
        ("mtp_num_hidden_layers", "mtp_num_layers"),
    ]

    # ---- activations and dtypes ----
    @classmethod
    def hf_to_megatron_activation(cls, hidden_act: str):
        if hidden_act not in ACTIVATION_FUNC_MAP:
            raise ValueError(
                f"Unsupported activation function: {hidden_act}. Supported: {list(ACTIVATION_FUNC_MAP)}"
            )
        return ACTIVATION_FUNC_MAP[hidden_act]

    @classmethod
    def megatron_to_hf_activation(cls, activation_func) -> str:
        for name, func in ACTIVATION_FUNC_MAP.items():
            if func is activation_func:
                return name
        raise ValueError(f"Unsupported activation function: {activation_func}")

    def dtype_from_str(self, dtype: str) -> torch.dtype:
        """A precision name (``bfloat16``, ``bf16``, ``fp16``, ...) as a dtype; float32 when unknown."""
        return _DTYPES.get(dtype.removeprefix("torch."), torch.float32)

    def dtype_from_hf(self, config, default=None) -> torch.dtype:
        """The weights' dtype a config names (``torch_dtype``, or ``dtype`` as transformers >= 4.56
        writes it); ``default`` when it names none."""
        for key in ("dtype", "torch_dtype"):  # transformers' current name first: the old one warns
            value = getattr(config, key, None)
            if isinstance(value, torch.dtype):
                return value
            if isinstance(value, str):
                return self.dtype_from_str(value)
        if default is not None:
            return default
        raise ValueError("torch_dtype is not of type str/torch.dtype")

    def make_vocab_size_divisible_by(self, vocab_size: int) -> int:
        return make_vocab_size_divisible_by(vocab_size)

    # ---- Hugging Face -> megatron ----
    def _should_map_hf_config_field(
        self, hf_config: Any, hf_name: str, megatron_name: str, value: Any
    ) -> bool:
        """Whether a CONFIG_MAPPING field is taken (a family may skip one)."""
        return True

    def _hf_config_to_megatron_kwargs(self, hf_config) -> dict[str, Any]:
        """The provider fields CONFIG_MAPPING reads from ``hf_config``, with the rotary base, vocabulary
        padding, precision and activation."""
        cfg = HFConfig(hf_config, self.hf_config_defaults)
        kwargs: dict[str, Any] = {}
        for hf_name, megatron_name in self.CONFIG_MAPPING:
            if megatron_name in kwargs or not hasattr(cfg, hf_name):
                continue
            value = getattr(cfg, hf_name)
            if self._should_map_hf_config_field(cfg, hf_name, megatron_name, value):
                kwargs[megatron_name] = value
        if kwargs.get("rotary_base") is None:
            kwargs.pop("rotary_base", None)
            try:
                kwargs["rotary_base"] = rope_theta_from_hf(cfg)
            except ValueError:
                pass
        if isinstance(kwargs.get("rotary_base"), float) and kwargs["rotary_base"].is_integer():
            kwargs["rotary_base"] = int(kwargs["rotary_base"])  # as megatron's --rotary-base (an int)
        vocab_size = kwargs.get("vocab_size")
        if isinstance(vocab_size, int):
            kwargs["make_vocab_size_divisible_by"] = self.make_vocab_size_divisible_by(vocab_size)
        params_dtype = self.dtype_from_hf(cfg, default=torch.float32)
        kwargs.update(
            fp16=params_dtype == torch.float16, bf16=params_dtype == torch.bfloat16, params_dtype=params_dtype
        )
        hidden_act = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"
        kwargs["activation_func"] = self.hf_to_megatron_activation(hidden_act)
        return kwargs

    def hf_config_to_provider_kwargs(self, hf_config) -> dict[str, Any]:
        """GPTModelProvider fields of ``hf_config`` (families override hf_config_to_model_config_kwargs)."""
        return self._hf_config_to_megatron_kwargs(hf_config)

    def hf_config_to_model_config_kwargs(self, hf_config) -> dict[str, Any]:
        """The model's fields from ``hf_config``, with the training defaults Megatron-Bridge sets on
        every imported model (the fused loss, freeing pipeline outputs, fused weight-gradient adds)."""
        kwargs = self._hf_config_to_megatron_kwargs(hf_config)
        kwargs.update(
            attention_softmax_in_fp32=False,
            cross_entropy_loss_fusion=True,
            deallocate_pipeline_outputs=True,
            gradient_accumulation_fusion=True,
        )
        return kwargs

    def hf_config_to_model_config(self, hf_config):
        """``MODEL_CONFIG_CLASS`` (BridgeGPTModelConfig) of ``hf_config``: each field to the outer
        config or its nested transformer config, whichever declares it (ValueError for neither)."""
        if self.MODEL_CONFIG_CLASS is None:
            raise NotImplementedError(
                f"{type(self).__name__} builds no model config (MODEL_CONFIG_CLASS is None)"
            )
        kwargs = self.hf_config_to_model_config_kwargs(hf_config)
        outer = {f.name for f in fields(self.MODEL_CONFIG_CLASS) if f.init} - {"transformer"}
        inner = {f.name for f in fields(self.TRANSFORMER_CONFIG_CLASS) if f.init}
        unknown = sorted(set(kwargs) - outer - inner)
        if unknown:
            raise ValueError(
                f"Cannot map Hugging Face config fields to {self.MODEL_CONFIG_CLASS.__name__} + "
                f"{self.TRANSFORMER_CONFIG_CLASS.__name__}: {unknown}"
            )
        transformer = self.TRANSFORMER_CONFIG_CLASS(**{k: v for k, v in kwargs.items() if k in inner - outer})
        return self.MODEL_CONFIG_CLASS(
            transformer=transformer, **{k: v for k, v in kwargs.items() if k in outer}
        )

    def check_hf_config(self, cfg: HFConfig) -> None:
        """Refuse (``cfg.refuse``) what megatron_lite cannot build; a family adds its checks."""

    def provider_bridge(self, hf_pretrained) -> GPTModelProvider:
        """The provider of the model ``hf_pretrained`` describes: a model with a ``config``, a
        transformers config, or config.json's dict. A config megatron_lite cannot build is one
        BridgeError line naming the field."""
        hf_config = hf_pretrained
        if not isinstance(hf_pretrained, dict) and hasattr(hf_pretrained, "config"):
            hf_config = hf_pretrained.config
        self.hf_config = hf_config
        cfg = HFConfig(hf_config, self.hf_config_defaults)
        provider_class = self.PROVIDER_CLASS or GPTModelProvider
        accepted = {f.name for f in fields(provider_class) if f.init}
        try:
            self.check_hf_config(cfg)
            kwargs = _shape_checked(self.hf_config_to_provider_kwargs(cfg))
            return provider_class(**{k: v for k, v in kwargs.items() if k in accepted})
        except BridgeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
            # A value of the wrong type or a missing key inside a field (rope_scaling without factor).
            raise BridgeError(
                f"config.json: cannot be read as a {self.MODEL_TYPE} model ({type(err).__name__}: {err})"
            ) from None

    # ---- megatron -> Hugging Face ----
    @classmethod
    def megatron_to_hf_config(cls, provider) -> dict:
        """The Hugging Face config (a dict) of ``provider``'s model: CONFIG_MAPPING backwards, the
        activation and dtype by name, ``architectures`` and ``model_type``."""
        hf_config: dict[str, Any] = {}
        for hf_name, megatron_name in cls.CONFIG_MAPPING:
            if hasattr(provider, megatron_name):
                hf_config[hf_name] = getattr(provider, megatron_name)
        activation = getattr(provider, "activation_func", None)
        if activation is not None:
            hf_config["hidden_act"] = cls.megatron_to_hf_activation(activation)
        if getattr(provider, "bf16", False):
            hf_config["torch_dtype"] = "bfloat16"
        elif getattr(provider, "fp16", False):
            hf_config["torch_dtype"] = "float16"
        else:
            hf_config["torch_dtype"] = "float32"
        if cls.SOURCE_NAME is not None:
            hf_config["architectures"] = [cls.SOURCE_NAME]
        if cls.MODEL_TYPE is not None:
            hf_config["model_type"] = cls.MODEL_TYPE
        return hf_config

    @classmethod
    def source_config_checked(cls, source: dict, model_config) -> dict:
        """The source's config.json for an export, every key it had kept, once checked to describe
        the model being exported (BridgeError, one line, naming the first field that differs)."""
        again = cls().provider_bridge(source)
        names = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size")
        for name in (*names, "num_moe_experts", "moe_layer_freq"):
            if getattr(again, name) != getattr(model_config, name):
                raise BridgeError(
                    f"config.json describes {name}={getattr(again, name)} but the model has "
                    f"{getattr(model_config, name)}; export with the config of the model that was imported"
                )
        return dict(source)
