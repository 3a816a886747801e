"""What the routers saw during a step, gathered for the dashboards (megatron-core's MoE metrics
tracker, get_moe_metrics_tracker): each MoE layer's auxiliary losses and, for memory, the tokens each
expert received.

Routers ``record`` during forward (summed over the step's microbatches); ``report`` then reduces over
the ranks and returns the scalars. Losses are reduced as upstream: summed over the pipeline (each
stage fills its own layers), over the group that splits a sequence (its parts' losses add up), then
averaged over data parallelism; the logged value is the mean over MoE layers per microbatch. Token
counts are summed over all of it: ``moe/tokens_per_expert/...`` is what the whole global batch sent
to each expert, the routers' own count whatever the layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from megatron_lite.core.process_group_utils import get_pg_size


class MoEMetricsTracker:
    def __init__(self):
        self.losses: dict[str, torch.Tensor] = {}  # name -> [num_layers]
        self.tokens: torch.Tensor | None = None  # [num_layers, num_experts]

    def record(self, name: str, value: torch.Tensor, layer_number: int, num_layers: int) -> None:
        """Add a scalar loss of layer ``layer_number`` (1-based)."""
        # Fresh for another model (or a fake-tensor dry run after a real one in the same process).
        if not _fits(self.losses.get(name), (num_layers,), value):
            self.losses[name] = torch.zeros(num_layers, dtype=torch.float64, device=value.device)
        self.losses[name][layer_number - 1] += value.detach().to(torch.float64)

    def record_tokens(self, counts: torch.Tensor, layer_number: int, num_layers: int) -> None:
        """Add the tokens each expert of layer ``layer_number`` was given ([num_experts])."""
        if not _fits(self.tokens, (num_layers, counts.numel()), counts):
            self.tokens = torch.zeros(num_layers, counts.numel(), dtype=torch.float64, device=counts.device)
        self.tokens[layer_number - 1] += counts.detach().to(torch.float64)

    def clear(self) -> None:
        self.losses.clear()
        self.tokens = None

    def report(
        self,
        *,
        pg_collection,
        seq_group,
        num_microbatches: int,
        moe_layers: list[int],
        loss_names: list[str],
        num_layers: int,
        num_experts: int | None,
        device,
        per_layer: bool = False,
    ) -> tuple[dict, str]:
        """``(scalars, console text)`` for the step recorded so far, then clear. ``seq_group``: the
        ranks holding parts of one sequence (tensor-parallel with sequence parallelism, and context
        parallel), whose values add up. Collective over the pipeline, ``seq_group`` and data-parallel
        groups: call on every rank of a MoE model (a stage without MoE layers adds zeros).
        ``num_experts`` None leaves the token counts out (upstream's track_moe_metrics reports losses
        only); ``per_layer`` adds upstream's ``moe/<name>_layer_<i>`` (0-based, every layer)."""
        scalars: dict = {}
        for name in loss_names:
            values = self.losses.get(name)
            values = torch.zeros(num_layers, dtype=torch.float64) if values is None else values
            values = values.to(device)
            _all_reduce(values, pg_collection.pp)
            _all_reduce(values, seq_group)
            _all_reduce(values, pg_collection.dp, mean=True)
            scalars[name] = float(values.sum()) / num_microbatches / max(len(moe_layers), 1)
            if per_layer:
                for i, value in enumerate((values / num_microbatches).tolist()):
                    scalars[f"moe/{name}_layer_{i}"] = value
        text = "".join(f" {name}: {scalars[name]:.2f} |" for name in loss_names)
        if num_experts is None:
            self.clear()
            return scalars, text
        tokens = self.tokens
        tokens = torch.zeros(num_layers, num_experts, dtype=torch.float64) if tokens is None else tokens
        tokens = tokens.to(device)
        _all_reduce(tokens, pg_collection.pp)
        _all_reduce(tokens, seq_group)
        _all_reduce(tokens, pg_collection.dp)
        scalars.update(token_scalars(tokens.cpu(), moe_layers))
        self.clear()
        return scalars, text


def token_scalars(tokens: torch.Tensor, moe_layers: list[int]) -> dict:
    """Dashboard scalars from ``tokens[layer - 1, expert]``: each expert's count, each layer's
    max / mean imbalance, and the worst layer's."""
    scalars: dict = {}
    worst = 0.0
    for layer in moe_layers:
        counts = tokens[layer - 1]
        for expert, count in enumerate(counts.tolist()):
            scalars[f"moe/tokens_per_expert/layer_{layer}/expert_{expert}"] = int(count)
        mean = float(counts.mean())
        imbalance = float(counts.max()) / mean if mean > 0 else 0.0
        scalars[f"moe/tokens_imbalance/layer_{layer}"] = imbalance
        worst = max(worst, imbalance)
    scalars["moe/tokens_imbalance"] = worst
    return scalars


def _fits(tensor: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> bool:
    return (
        tensor is not None
        and tuple(tensor.shape) == shape
        and tensor.device == like.device
        and is_fake(tensor) == is_fake(like)
    )


def _all_reduce(tensor: torch.Tensor, group, mean: bool = False) -> None:
    if get_pg_size(group) > 1:
        dist.all_reduce(tensor, group=group)
        if mean:
            tensor.div_(get_pg_size(group))


_TRACKER = MoEMetricsTracker()


def get_moe_metrics_tracker() -> MoEMetricsTracker:
    """The process's tracker (one per process, as upstream)."""
    return _TRACKER
