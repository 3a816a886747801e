"""Where a MoE layer's routed experts sit in a ``torch_dist`` checkpoint: megatron-core's
``TEGroupedMLP`` / ``SequentialMLP.sharded_state_dict`` keys, the same for both, so a checkpoint of
either loads into the other.

Local expert i of a rank (``mlp.experts.linear_fc1.weight<i>`` grouped, or
``mlp.experts.local_experts.<i>.linear_fc1.weight`` sequential) is expert ``ep_rank * E / ep + i`` of
the global tensor ``mlp.experts.experts.linear_fc1.weight``, whose axes are [layer,] expert, then the
weight's own, split over the expert tensor-parallel ranks as the dense MLP is over TP (fc1 by rows, a
gated fc1 as ``[gate; value]``; fc2 by columns, its bias whole).
"""

from __future__ import annotations

import re

_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<seq_fc>linear_fc[12])\.(?P<seq_kind>weight|bias)"
    r"|(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)(?P<grouped>\d+))$"
)


def routed_expert(name: str) -> tuple[str, int] | None:
    """``(checkpoint name within the layer, local expert index)`` for a routed expert's parameter
    (``mlp.experts.experts.linear_fc1.weight``, i); None for any other entry."""
    match = _EXPERT.search(name)
    if match is None:
        return None
    if match["seq"] is not None:
        fc, kind, local = match["seq_fc"], match["seq_kind"], int(match["seq"])
    else:
        fc, kind, local = match["fc"], match["kind"], int(match["grouped"])
    return f"mlp.experts.experts.{fc}.{kind}", local


def expert_split_dim(name: str) -> int | None:
    """The dim a routed expert's tensor is split along over expert-TP ranks (None: replicated), by its
    checkpoint name or a module's (``linear_fc2.weight<i>``, ``local_experts.<i>.linear_fc2.weight``)."""
    if ".linear_fc1." in name:
        return 0
    return 1 if ".linear_fc2.weight" in name else None
