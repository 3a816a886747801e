"""HyperCommGrid: process groups over named dimensions of a rank grid (as in Megatron core).

``HyperCommGrid([2, 1, 4, 1], ["tp", "cp", "pp", "dp"])`` lays ranks out as
``initialize_model_parallel(order="tp-cp-pp-dp")`` does: the first name varies fastest. A group over
some dimensions holds the ranks that differ only in those dimensions. Building the groups of one
dimension set is a collective over the world (every rank must call ``create_pg`` alike).
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist


class HyperCommGrid:
    """A ``shape`` grid of ``prod(shape)`` ranks starting at ``rank_offset``, dimensions named ``dim_names``."""

    def __init__(
        self, shape: list[int], dim_names: list[str], rank_offset: int = 0, backend: str | None = None
    ):
        if len(shape) != len(dim_names):
            raise ValueError(f"len(shape) {shape} != len(dim_names) {dim_names}")
        if rank_offset < 0:
            raise ValueError(f"rank_offset must be non-negative, got {rank_offset}")
        if "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        elif dist.is_initialized():
            world_size = dist.get_world_size()
        else:
            raise RuntimeError("cannot size the grid: set WORLD_SIZE or initialise torch.distributed first")
        self.shape, self.dim_names = list(shape), list(dim_names)
        self.rank_offset, self.backend = rank_offset, backend
        self.size = math.prod(shape)
        if self.size > world_size - rank_offset:
            raise RuntimeError(
                f"grid {shape} needs {self.size} ranks; world {world_size}, offset {rank_offset}"
            )
        self._pgs: dict[str, object] = {}

    def _ordered(self, dims: str | list[str]) -> list[str]:
        """``dims`` in the grid's slowest-to-fastest order (the key a group is stored under)."""
        dims = [dims] if isinstance(dims, str) else list(dims)
        missing = [d for d in dims if d not in self.dim_names]
        if missing:
            raise ValueError(f"{missing[0]!r} is not in dim_names {self.dim_names}")
        reverse = self.dim_names[::-1]
        return sorted(dims, key=reverse.index)

    def get_rank_enum(self, dims: str | list[str]) -> list[list[int]]:
        """The rank lists of the groups over ``dims``: one list per combination of the other dimensions."""
        dims = self._ordered(dims)
        reverse = self.dim_names[::-1]
        sizes = dict(zip(self.dim_names, self.shape))
        # Row-major over the reversed names makes the first name the fastest-varying one.
        ranks = torch.arange(self.rank_offset, self.rank_offset + self.size).reshape(
            [sizes[d] for d in reverse]
        )
        others = [reverse.index(d) for d in reverse if d not in dims]
        grouped = ranks.permute(others + [reverse.index(d) for d in dims])
        return grouped.reshape(-1, math.prod(sizes[d] for d in dims)).tolist()

    def create_pg(self, dims: str | list[str], **kwargs):
        """Build the groups over ``dims`` (collective over the world) and return this rank's, or None
        if this rank is outside the grid. Each dimension set can be created once."""
        key = "-".join(self._ordered(dims))
        if key in self._pgs:
            raise KeyError(f"process group {dims} was already created; use get_pg")
        pg, _ = dist.new_subgroups_by_enumeration(self.get_rank_enum(dims), backend=self.backend, **kwargs)
        self._pgs[key] = pg
        return pg

    def get_pg(self, dims: str | list[str]):
        """The group ``create_pg(dims)`` built."""
        key = "-".join(self._ordered(dims))
        if key not in self._pgs:
            raise KeyError(f"process group for {key} has not been created; call create_pg first")
        return self._pgs[key]

    def is_current_rank_in_grid(self) -> bool:
        return self.rank_offset <= dist.get_rank() < self.rank_offset + self.size

    def destroy(self) -> None:
        """Destroy the groups this rank belongs to."""
        for pg in self._pgs.values():
            if pg is not None and pg is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(pg)
        self._pgs.clear()
