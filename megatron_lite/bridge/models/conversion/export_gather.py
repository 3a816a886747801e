"""Whole tensors for export from a model spread over TP, expert-TP and PP ranks: which stage holds each
parameter (one all-gather of names and shapes), in which order every rank converts them, and the
mapping adapter that gathers one parameter's shards (TP all-gather on its stage, then a PP broadcast)
and gives its Hugging Face tensors. Every rank runs the same tasks in the same order: no rank holds
more than one whole tensor at a time."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.bridge.models.conversion import experts
from megatron_lite.core import parallel_state
from megatron_lite.core.models.gpt.state_dict_sharding import global_name, layer_index


def model_groups(chunk):
    """(tp, pp, expert tp, ep): the expert groups fall back to (tp, none) where no MoE built them."""
    pg = getattr(chunk, "pg_collection", None)
    if pg is not None:
        tp, pp, expt_tp, ep = pg.tp, pg.pp, pg.expt_tp, pg.ep
    else:
        tp = parallel_state.get_tensor_model_parallel_group()
        pp = parallel_state.get_pipeline_model_parallel_group()
        expt_tp = parallel_state.get_expert_tensor_parallel_group(check_initialized=False)
        ep = parallel_state.get_expert_model_parallel_group(check_initialized=False)
    return tp, pp, expt_tp if expt_tp is not None else tp, ep


def layer_offset(chunk) -> int:
    layers = chunk.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def named_global_parameters(chunk):
    """A chunk's parameters by their whole-model names: global layer numbers and expert indices."""
    offset = layer_offset(chunk)
    for name, param in experts.named_parameters(chunk):
        yield global_name(name, offset), param


def export_order(name: str):
    """Embedding first, then the layers in order, then the rest (final norm, output layer)."""
    index = layer_index(name)
    return (0 if name.startswith("embedding") else 2 if index is None else 1, index or 0, name)


def stage_parameters(chunks: list, config) -> dict:
    """This rank's {whole-model name: (parameter, virtual stage, chunk)} to export: a tied output layer's
    copy of the embedding is the embedding's, exported once."""
    entries = {}
    for vp_stage, chunk in enumerate(chunks):
        for name, param in named_global_parameters(chunk):
            if name == "output_layer.weight" and config.share_embeddings_and_output_weights:
                continue
            entries.setdefault(name, (param, vp_stage, chunk))
    return entries


def owners_over_stages(entries: dict, pp_group) -> dict:
    """{name: (pipeline rank holding it first, shape, dtype)} over every stage (collective over PP)."""
    gathered: list = [None] * dist.get_world_size(pp_group)
    mine = {name: (tuple(p.shape), p.dtype) for name, (p, _, _) in entries.items()}
    dist.all_gather_object(gathered, mine, group=pp_group)
    owners = {}
    for stage, names in enumerate(gathered):
        for name, (shape, dtype) in names.items():
            owners.setdefault(name, (stage, shape, dtype))
    return owners


class WholeTensorExport:
    """A registry mapping as the export loop calls it: ``megatron_to_hf(shard or None, module)`` gives
    the Hugging Face tensors of the whole parameter, on every rank (collective over TP / expert TP
    on the owning stage and over PP)."""

    def __init__(self, mapping, name: str, owner: tuple, groups: tuple, config, device):
        self.mapping, self.name, self.config, self.device = mapping, name, config, device
        self.stage, self.shape, self.dtype = owner
        self.tp_group, self.pp_group, self.expt_tp_group = groups

    @property
    def hf_param(self):
        return self.mapping.hf_param

    def megatron_to_hf(self, megatron_weights, megatron_module) -> dict[str, torch.Tensor]:
        return self.mapping.full_to_hf(self.whole(megatron_weights), self.config)

    def whole(self, megatron_weights) -> torch.Tensor:
        """The whole megatron tensor (TP-merged), on every rank."""
        if megatron_weights is not None and self.stage == dist.get_rank(self.pp_group):
            local = megatron_weights.detach()
            group = self.expt_tp_group if experts.is_expert_param(self.name) else self.tp_group
            shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(shards, local.contiguous(), group=group)
            full = experts.merge_shards(self.name, shards, self.config).contiguous()
            meta = torch.tensor(full.shape, device=self.device)
        else:
            full, meta = None, torch.zeros(len(self.shape), dtype=torch.long, device=self.device)
        if dist.get_world_size(self.pp_group) > 1:
            src = dist.get_global_rank(self.pp_group, self.stage)
            dist.broadcast(meta, src, group=self.pp_group)
            if full is None:
                full = torch.empty(tuple(meta.tolist()), dtype=self.dtype, device=self.device)
            dist.broadcast(full, src, group=self.pp_group)
        return full
