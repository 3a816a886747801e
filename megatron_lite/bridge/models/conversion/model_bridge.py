"""MegatronModelBridge: one model family's config translation and weight mappings, and the two weight
streams every family shares (Hugging Face -> this rank's shards, all ranks' shards -> Hugging Face)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.conversion import experts
from megatron_lite.bridge.models.conversion.errors import BridgeError
from megatron_lite.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron_lite.core import parallel_state
from megatron_lite.core.models.gpt.state_dict_sharding import global_name, layer_index
from megatron_lite.models.gpt_provider import GPTModelProvider

_BRIDGES: dict[str, type[MegatronModelBridge]] = {}


def make_vocab_size_divisible_by(vocab_size: int) -> int:
    """The largest power of two up to 128 dividing the vocabulary (Megatron-Bridge's rule): at TP 1 the
    model gets no padding rows, whose logits would otherwise join the softmax."""
    divisor = 128
    while vocab_size % divisor:
        divisor //= 2
    return divisor


def _groups(chunk):
    """(tp, pp, expert tp, ep): the expert groups fall back to (tp, none) where no MoE built them."""
    pg = getattr(chunk, "pg_collection", None)
    if pg is not None:
        groups = pg.tp, pg.pp, pg.expt_tp, pg.ep
    else:
        groups = (
            parallel_state.get_tensor_model_parallel_group(),
            parallel_state.get_pipeline_model_parallel_group(),
            parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
            parallel_state.get_expert_model_parallel_group(check_initialized=False),
        )
    tp, pp, expt_tp, ep = groups
    return tp, pp, expt_tp if expt_tp is not None else tp, ep


def _named_parameters(chunk):
    """A chunk's parameters by their whole-model names: global layer numbers and expert indices."""
    offset = _layer_offset(chunk)
    for name, param in experts.named_parameters(chunk):
        yield global_name(name, offset), param


def _layer_offset(chunk) -> int:
    layers = chunk.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


class MegatronModelBridge:
    """Subclasses name their ``model_type`` (config.json's) and give ``provider_kwargs`` and
    ``mapping_registry``; ``register_bridge`` makes ``AutoBridge`` find them."""

    model_type: str = ""
    # Tensors a directory may hold that are no weights of ours (buffers some versions saved).
    ignored_hf_suffixes: tuple[str, ...] = ("rotary_emb.inv_freq",)
    optional_hf_prefix: str = ""

    @staticmethod
    def register_bridge(model_type: str):
        def register(cls):
            cls.model_type = model_type
            _BRIDGES[model_type] = cls
            return cls

        return register

    @staticmethod
    def for_model_type(model_type: str | None) -> type[MegatronModelBridge]:
        if model_type not in _BRIDGES:
            raise BridgeError(
                f"config.json: model_type {model_type!r} is not supported; megatron_lite imports "
                f"{', '.join(sorted(_BRIDGES))}"
            )
        return _BRIDGES[model_type]

    @staticmethod
    def supported_model_types() -> list[str]:
        return sorted(_BRIDGES)

    # ---- config ----
    def provider_kwargs(self, hf: dict) -> dict:
        raise NotImplementedError

    def provider_bridge(self, hf: dict) -> GPTModelProvider:
        """The GPTModelProvider a config.json describes (one-line BridgeError for what it cannot)."""
        try:
            kwargs = self.provider_kwargs(hf)
            heads, groups = kwargs["num_attention_heads"], kwargs["num_query_groups"]
            if min(kwargs["num_layers"], kwargs["hidden_size"], heads, groups, kwargs["kv_channels"]) < 1:
                raise BridgeError("config.json: layers, hidden size, heads and head size must be positive")
            if heads % groups:
                raise BridgeError(
                    f"config.json: {heads} attention heads do not split into {groups} key-value heads"
                )
            return GPTModelProvider(**kwargs)
        except BridgeError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as err:
            # A value of the wrong type or a missing key inside a field (rope_scaling without factor).
            raise BridgeError(
                f"config.json: cannot be read as a {self.model_type} model ({type(err).__name__}: {err})"
            ) from None

    def mapping_registry(self, config) -> MegatronMappingRegistry:
        raise NotImplementedError

    # ---- Hugging Face -> megatron ----
    def load_weights_hf_to_megatron(
        self, checkpoint, model_chunks: list, config, show_progress=False
    ) -> None:
        """Fill every parameter of this rank's chunks with its TP shard, read straight from the files.
        Not collective: each rank reads its own layers only."""
        registry = self.mapping_registry(config)
        unknown = checkpoint.names() - registry.hf_names(config)
        if config.share_embeddings_and_output_weights:
            unknown.discard("lm_head.weight")  # some tied models' files carry the tied copy too
        unknown = sorted(n for n in unknown if not n.endswith(self.ignored_hf_suffixes))
        if unknown:
            raise BridgeError(
                f"{checkpoint.path}: tensor {unknown[0]} ({len(unknown)} in all) has no place in a "
                f"megatron_lite {self.model_type} model"
            )
        for chunk in model_chunks:
            tp_group, _, expt_tp_group, _ = _groups(chunk)
            with torch.no_grad():
                for full_name, param in _named_parameters(chunk):
                    # A routed expert splits over the expert-TP ranks, everything else over TP.
                    group = expt_tp_group if experts.is_expert_param(full_name) else tp_group
                    tp_rank, tp_size = dist.get_rank(group), dist.get_world_size(group)
                    mapping = registry.megatron_to_hf_lookup(full_name)
                    if mapping is None:
                        raise BridgeError(f"no Hugging Face tensor maps to {full_name}")
                    try:
                        shard = mapping.read_shard(
                            checkpoint.read, tuple(param.shape), tp_rank, tp_size, config
                        )
                    except RuntimeError:  # a tensor whose size cannot make this parameter (reshaped)
                        shard = None
                    if shard is None or tuple(shard.shape) != tuple(param.shape):
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

    # ---- megatron -> Hugging Face ----
    def _stage_entries(self, model_chunks: list, config) -> list[tuple[str, object]]:
        """This rank's (whole-model name, parameter) pairs to export: a tied output layer's copy of
        the embedding is the embedding's, exported once."""
        entries = []
        for chunk in model_chunks:
            for name, param in _named_parameters(chunk):
                if name == "output_layer.weight" and config.share_embeddings_and_output_weights:
                    continue
                entries.append((name, param))
        return entries

    def stream_weights_megatron_to_hf(self, model_chunks: list, config, cpu: bool = True):
        """(Hugging Face name, whole tensor) for every weight, on every rank, in layer order. Collective
        over each rank's TP, expert-TP and PP groups, tensor by tensor: no rank holds more than one at
        a time. Refused (BridgeError) at expert parallel size > 1."""
        registry = self.mapping_registry(config)
        tp_group, pp_group, expt_tp_group, ep_group = _groups(model_chunks[0])
        if ep_group is not None and dist.get_world_size(ep_group) > 1:
            raise BridgeError(
                "export at expert_model_parallel_size > 1 is not supported: each rank holds some experts "
                "only; export from a checkpoint loaded at expert parallel size 1"
            )
        entries = dict(self._stage_entries(model_chunks, config))
        # NCCL moves device tensors only: the shapes and received tensors live where the weights do.
        device = next(model_chunks[0].parameters()).device
        gathered: list = [None] * dist.get_world_size(pp_group)
        mine = {name: (tuple(p.shape), p.dtype) for name, p in entries.items()}
        dist.all_gather_object(gathered, mine, group=pp_group)
        owners = {}
        for stage, names in enumerate(gathered):
            for name, meta in names.items():
                owners.setdefault(name, (stage, meta))

        def order(name: str):
            index = layer_index(name)
            return (0 if name.startswith("embedding") else 2 if index is None else 1, index or 0, name)

        for name in sorted(owners, key=order):
            stage, (shape, dtype) = owners[name]
            if name in entries and stage == dist.get_rank(pp_group):
                local = entries[name].detach()
                group = expt_tp_group if experts.is_expert_param(name) else tp_group
                shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
                dist.all_gather(shards, local.contiguous(), group=group)
                full = experts.merge_shards(name, shards, config).contiguous()
                meta = torch.tensor(full.shape, device=device)
            else:
                full, meta = None, torch.zeros(len(shape), dtype=torch.long, device=device)
            src = dist.get_global_rank(pp_group, stage)
            if dist.get_world_size(pp_group) > 1:
                dist.broadcast(meta, src, group=pp_group)
                if full is None:
                    full = torch.empty(tuple(meta.tolist()), dtype=dtype, device=device)
                dist.broadcast(full, src, group=pp_group)
            mapping = registry.megatron_to_hf_lookup(name)
            if mapping is None:
                raise BridgeError(f"{name} has no Hugging Face name in a {self.model_type} model")
            for hf_name, tensor in mapping.full_to_hf(full, config).items():
                yield hf_name, tensor.cpu() if cpu else tensor

    # ---- config back ----
    def megatron_to_hf_config(self, hf: dict, config) -> dict:
        """config.json for ``config``: the source's, checked to describe the same model."""
        again = self.provider_bridge(hf)
        fields = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "vocab_size")
        for field in (*fields, "num_moe_experts", "moe_layer_freq"):
            if getattr(again, field) != getattr(config, field):
                raise BridgeError(
                    f"config.json describes {field}={getattr(again, field)} but the model has "
                    f"{getattr(config, field)}; export with the config of the model that was imported"
                )
        return dict(hf)
