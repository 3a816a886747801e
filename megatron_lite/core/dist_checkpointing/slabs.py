"""Where the flat elements of a model's local parameter land in a checkpoint's global tensors: the
geometry behind ``mapping.flat_range_pieces`` (megatron_lite's own; megatron-core builds its pieces
per layer class instead)."""

from __future__ import annotations

from dataclasses import dataclass


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


def flat_range_places(slabs: list[Slab], local_shape, start: int, stop: int):
    """Per rectangle of the global tensors that flat elements ``[start, stop)`` of a local tensor of
    ``local_shape`` (at most 2-D) cover: ``(slab, at, shape, global_offset, global_shape)``, the
    rectangle's first element counted from ``start`` and its shape with the prepended axes."""
    row = 1 if len(local_shape) < 2 else local_shape[1]
    assert len(local_shape) <= 2, f"{slabs[0].key}: a {len(local_shape)}-D tensor has no flat pieces here"
    for slab in slabs:
        x, y = max(start, slab.start * row), min(stop, slab.stop * row)
        for r, c, n_rows, n_cols in _rectangles(x, y, row) if x < y else ():
            offset = list(slab.global_offset)
            offset[0] += r - slab.start
            shape = (n_rows, n_cols) if len(local_shape) == 2 else (n_rows,)
            if len(local_shape) == 2:
                offset[1] += c
            global_shape, offset = tuple(slab.global_shape), tuple(offset)
            for axis in (slab.expert, slab.layer):  # prepended innermost first: [layer, expert, ...]
                if axis is not None:
                    shape, offset = (1, *shape), (axis[0], *offset)
                    global_shape = (axis[1], *global_shape)
            yield slab, r * row + c - start, shape, offset, global_shape
