"""What a rank contributes to a distributed checkpoint: megatron-core's ``ShardedTensor``, one
rectangular piece of a named global tensor with its place in it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ShardedTensor:
    """``data`` is the piece of the global tensor ``key`` (of ``global_shape``) that starts at
    ``global_offset``. The rank with ``replica_id == 0`` writes it; every rank holding it reads it.
    ``allow_shape_mismatch`` (a padded vocabulary): a load takes the overlap with the saved tensor and
    leaves the rest of ``data`` as it is."""

    key: str
    data: torch.Tensor
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    replica_id: int = 0
    allow_shape_mismatch: bool = False

    def __post_init__(self) -> None:
        shape = tuple(self.data.shape)
        if not (len(shape) == len(self.global_shape) == len(self.global_offset)) or any(
            o + s > g for o, s, g in zip(self.global_offset, shape, self.global_shape)
        ):
            raise ValueError(
                f"{self.key}: a {shape} piece at {self.global_offset} does not fit in {self.global_shape}"
            )


@dataclass(frozen=True)
class Slab:
    """Rows ``[start, stop)`` of a local tensor (its first dim) that sit at ``global_offset`` of the
    global tensor ``key``: how a model's local parameter maps onto the checkpoint's tensors (a TP
    shard is one slab; a gated ``linear_fc1`` shard two, its gate rows and its up rows).
    ``layer``: the stacked-layers index prepended to the global tensor, None for a tensor outside
    the layers."""

    key: str
    start: int
    stop: int
    global_offset: tuple[int, ...]
    global_shape: tuple[int, ...]
    layer: tuple[int, int] | None = None  # (index, number of layers)
    allow_shape_mismatch: bool = False
    expert: tuple[int, int] | None = None  # (global index, number of experts): an axis after the layer's


def _rectangles(x: int, y: int, row: int):
    """``(first row, first column, rows, columns)`` rectangles tiling flat elements ``[x, y)`` of a
    row-major tensor with rows of ``row`` elements: a partial first row, whole rows, a partial last."""
    while x < y:
        r, c = divmod(x, row)
        if c or y - x < row:
            n = min(row - c, y - x)
            yield r, c, 1, n
            x += n
        else:
            n = (y - x) // row
            yield r, 0, n, row
            x += n * row


def flat_range_pieces(
    slabs: list[Slab], local_shape, flat: torch.Tensor, start: int, replica_id: int = 0, prefix: str = ""
) -> list[ShardedTensor]:
    """The pieces of flat elements ``[start, start + flat.numel())`` of a local tensor of
    ``local_shape`` (at most 2-D), ``flat`` holding them: the distributed optimizer's shard of a
    parameter, or a whole parameter (``start`` 0). Each is a rectangle of the global tensor; ``prefix``
    names the global tensor (``optimizer.state.exp_avg.`` ...)."""
    row = 1 if len(local_shape) < 2 else local_shape[1]
    assert len(local_shape) <= 2, f"{slabs[0].key}: a {len(local_shape)}-D tensor has no flat pieces here"
    pieces = []
    stop = start + flat.numel()
    for slab in slabs:
        x, y = max(start, slab.start * row), min(stop, slab.stop * row)
        for r, c, n_rows, n_cols in _rectangles(x, y, row) if x < y else ():
            at = r * row + c - start
            data = flat[at : at + n_rows * n_cols]
            offset = list(slab.global_offset)
            offset[0] += r - slab.start
            shape = (n_rows, n_cols) if len(local_shape) == 2 else (n_rows,)
            if len(local_shape) == 2:
                offset[1] += c
            global_shape, offset = slab.global_shape, tuple(offset)
            for axis in (slab.expert, slab.layer):  # prepended innermost first: [layer, expert, ...]
                if axis is not None:
                    shape, offset = (1, *shape), (axis[0], *offset)
                    global_shape = (axis[1], *global_shape)
            pieces.append(
                ShardedTensor(
                    prefix + slab.key,
                    data.view(shape),
                    tuple(global_shape),
                    offset,
                    replica_id,
                    slab.allow_shape_mismatch,
                )
            )
    return pieces
