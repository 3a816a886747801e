"""A parameter mapping's process groups and the collectives it runs over them: Megatron-Bridge's
helpers on ``MegatronParamMapping``.

Each collective runs over the mapping's own ``tp_group`` / ``pp_group`` and does nothing on a group of one.
``torch.distributed`` is looked up at call time (not bound at import), so a test can stand it in.
"""

from __future__ import annotations

import torch


def _device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


class MappingCommunications:
    """Mixed into MegatronParamMapping, whose constructor sets ``pp_group``, ``ep_group``, ``_tp_group`` and
    ``_etp_group`` (None where parallel state is not initialized: a group of one)."""

    @property
    def is_expert(self) -> bool:
        return ".experts.linear_fc" in self.megatron_param or ".experts.local_experts." in self.megatron_param

    @property
    def tp_group(self):
        return self._etp_group if self.is_expert else self._tp_group

    @property
    def etp_group(self):
        return self._etp_group

    tp_size = property(lambda self: _size(self.tp_group))
    tp_rank = property(lambda self: _rank(self.tp_group))
    pp_size = property(lambda self: _size(self.pp_group))
    pp_rank = property(lambda self: _rank(self.pp_group))
    ep_size = property(lambda self: _size(self.ep_group))
    ep_rank = property(lambda self: _rank(self.ep_group))
    etp_size = property(lambda self: _size(self._etp_group))
    etp_rank = property(lambda self: _rank(self._etp_group))

    def set_process_groups_from_pg_collection(self, pg_collection) -> None:
        """Use ``pg_collection``'s groups instead of the global ones (children too)."""
        if pg_collection is None:
            return
        for attr, field in (
            ("pp_group", "pp"),
            ("ep_group", "ep"),
            ("_tp_group", "tp"),
            ("_etp_group", "expt_tp"),
        ):
            if getattr(pg_collection, field, None) is not None:
                setattr(self, attr, getattr(pg_collection, field))
        for child in vars(self).values():
            if isinstance(child, MappingCommunications):
                child.set_process_groups_from_pg_collection(pg_collection)

    def broadcast_from_pp_rank(self, tensor: torch.Tensor | None, cache_key: str | None = None):
        """The tensor on every PP rank, sent from the first rank that holds it (a tied or shared weight
        may sit on several). Collective over the PP group; ``cache_key`` skips the shape exchange when
        the same tensor comes again."""
        if self.pp_size == 1:
            return tensor
        specs = self._tensor_spec_output_cache.get(cache_key) if cache_key is not None else None
        if specs is None:
            spec = None
            if tensor is not None:
                tp_attrs = (
                    getattr(tensor, "tensor_model_parallel", None),
                    getattr(tensor, "partition_dim", None),
                )
                spec = (tensor.shape, tensor.dtype, *tp_attrs)
            specs = [None] * self.pp_size
            torch.distributed.all_gather_object(specs, spec, group=self.pp_group)
            if cache_key is not None:
                self._tensor_spec_output_cache[cache_key] = specs
        src = next((rank for rank, spec in enumerate(specs) if spec is not None), None)
        if src is None:
            raise ValueError(
                f"Object must exist on at least one PP rank: megatron_param={self.megatron_param}, "
                f"hf_param={self.hf_param}, cache_key={cache_key}"
            )
        if tensor is None:
            shape, dtype, tensor_parallel, partition_dim = specs[src]
            tensor = torch.empty(shape, dtype=dtype, device=_device())
            if tensor_parallel is not None:
                tensor.tensor_model_parallel = tensor_parallel
            if partition_dim is not None:
                tensor.partition_dim = partition_dim
        global_src = torch.distributed.get_global_rank(self.pp_group, src)
        torch.distributed.broadcast(tensor, src=global_src, group=self.pp_group)
        return tensor

    def broadcast_obj_from_pp_rank(self, obj, cache_key: str | None = None):
        """A picklable object on every PP rank, from the first rank that holds one (collective)."""
        if self.pp_size == 1:
            return obj
        if cache_key is not None and cache_key in self._broadcast_obj_cache:
            return self._broadcast_obj_cache[cache_key]
        flags = [None] * self.pp_size
        torch.distributed.all_gather_object(flags, obj is not None, group=self.pp_group)
        src = next((rank for rank, flag in enumerate(flags) if flag), None)
        if src is None:
            raise ValueError("Object must exist on at least one PP rank")
        objs = [obj]
        global_src = torch.distributed.get_process_group_ranks(self.pp_group)[src]
        torch.distributed.broadcast_object_list(objs, src=global_src, group=self.pp_group)
        if cache_key is not None:
            self._broadcast_obj_cache[cache_key] = objs[0]
        return objs[0]

    def clear_broadcast_cache(self) -> None:
        self._broadcast_obj_cache.clear()

    def clear_tensor_spec_output_cache(self) -> None:
        self._tensor_spec_output_cache.clear()

    def broadcast_tensor_to_tp_ranks(self, tensor: torch.Tensor, src_rank: int = 0) -> torch.Tensor:
        """``tensor`` from TP rank ``src_rank`` to every TP rank, in place (collective)."""
        if self.tp_size == 1:
            return tensor
        global_src = torch.distributed.get_global_rank(self.tp_group, src_rank)
        torch.distributed.broadcast(tensor, src=global_src, group=self.tp_group)
        return tensor

    def scatter_to_tp_ranks(self, splits, output_shape, dtype, device, src_rank: int = 0):
        """This rank's entry of ``splits`` (given on ``src_rank`` only), as ``dtype`` on ``device``."""
        if self.tp_size == 1:
            return splits[0].to(device=device, dtype=dtype) if splits else None
        output = torch.empty(output_shape, dtype=dtype, device=device)
        scatter_list = None
        if self.tp_rank == src_rank and splits:
            scatter_list = [s.to(device=device, dtype=dtype).contiguous() for s in splits]
        global_src = torch.distributed.get_global_rank(self.tp_group, src_rank)
        torch.distributed.scatter(output, scatter_list, src=global_src, group=self.tp_group)
        return output

    def gather_from_tp_ranks(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every TP rank's ``tensor``, in rank order (collective)."""
        if self.tp_size == 1:
            return [tensor]
        gathered = [torch.empty_like(tensor) for _ in range(self.tp_size)]
        torch.distributed.all_gather(gathered, tensor, group=self.tp_group)
        return gathered

    def _get_shard_spec(self, *, shard_size, megatron_module=None, global_size=None, global_size_attr=None):
        """(distinct shards, this rank's shard) where TP ranks may hold copies of fewer shards (key-value
        heads when num_query_groups < tp): the global size is ``global_size``, the module's
        ``global_size_attr``, or ``shard_size * tp``."""
        size = shard_size * self.tp_size
        if global_size is not None:
            size = global_size
        elif megatron_module is not None and global_size_attr is not None:
            size = getattr(megatron_module, global_size_attr, size)
        if size % shard_size:
            raise ValueError(f"Invalid sharded layout: global_size={size}, shard_size={shard_size}")
        shards = size // shard_size
        if self.tp_size % shards:
            raise ValueError(
                f"Invalid replicated shard layout: tp_size={self.tp_size}, shard_world_size={shards}"
            )
        return shards, self.tp_rank // (self.tp_size // shards)


def _size(group) -> int:
    return 1 if group is None else group.size()


def _rank(group) -> int:
    return 0 if group is None else group.rank()
