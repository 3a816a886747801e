"""Token dispatchers (megatron.core.transformer.moe.token_dispatcher): move each token to the ranks
holding its experts and the expert outputs back, with autograd-aware collectives (the backward
moves the gradients the opposite way).

``token_permutation(hidden [s, b, h], probs, routing_map)`` returns the tokens this rank's local
experts process, sorted by local expert, with each row's routing probability and the rows per
expert; ``token_unpermutation(expert_output)`` returns [s, b, h], each token's weighted expert
outputs summed. Both are collective over the expert-parallel groups (every rank of them calls).

- allgather: gather every token of the expert tensor-and-model-parallel group, keep the ones routed
  to local experts; the combine is the matching reduce-scatter (summing expert-tensor-parallel
  partial outputs on the way).
- alltoall: send each token only to the expert-parallel rank that owns its expert (one all-to-all),
  all-gather over the expert tensor-parallel group, and back the same way.

Where the rows per expert are read from the routing map's values (``nonzero``, ``tolist``), a routing
plan set with :func:`planned_routing` gives them instead: the preflight's dry run runs this code on
fake tensors, which have shapes but no values. No plan is ever set in a real run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size
from megatron_lite.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.core.transformer.moe.moe_utils import combine_rows

# (tokens, num_experts, local expert indices) -> rows of one rank's tokens each expert receives, the
# same for every rank whose tokens reach these local experts; set only by the dry run.
_routing_plan: Callable[[int, int, list[int]], list[int]] | None = None


@contextlib.contextmanager
def planned_routing(plan: Callable[[int, int, list[int]], list[int]]):
    """Within: the dispatchers route as ``plan`` says instead of as the routing map's values say (a
    dry run's: fake tensors have no values). Every tensor op runs as in a real run, on those sizes."""
    global _routing_plan
    before, _routing_plan = _routing_plan, plan
    try:
        yield
    finally:
        _routing_plan = before


def _planned(routing_map: torch.Tensor, local_expert_indices: list[int]) -> list[int] | None:
    """The plan's rows per expert for ``routing_map`` [tokens, experts] (one rank's), None in a real run."""
    if _routing_plan is None:
        return None
    return _routing_plan(routing_map.size(0), routing_map.size(1), local_expert_indices)


def _sort_by_expert(routing_map: torch.Tensor, probs: torch.Tensor, planned_pairs: int | None = None):
    """``(token indices, their probabilities)`` of every (token, expert) pair in ``routing_map``
    [tokens, experts], ordered by expert, then token (``planned_pairs`` of them under a plan)."""
    if planned_pairs is None:
        expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
    else:  # nonzero's own output, [pairs, 2] unbound: the indices' values unknown
        expert_idx, token_idx = routing_map.new_zeros((planned_pairs, 2), dtype=torch.long).unbind(1)
    return token_idx, probs.t()[expert_idx, token_idx]


def sort_chunks_by_idxs(input: torch.Tensor, split_sizes: list[int], sorted_idxs: list[int]) -> torch.Tensor:
    """``input`` cut into chunks of ``split_sizes`` rows, concatenated in the order ``sorted_idxs``."""
    chunks = input.split(split_sizes, dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)


class MoETokenDispatcher:
    def __init__(self, num_local_experts: int, local_expert_indices: list[int], config, pg_collection):
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = local_expert_indices
        self.ep_group = pg_collection.ep
        self.tp_group = pg_collection.expt_tp  # expert tensor parallelism
        self.tp_ep_group = pg_collection.tp_ep
        self.tokens_per_expert: torch.Tensor | None = None  # rows each local expert got, last forward


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.size(-1))
        planned = _planned(routing_map, self.local_expert_indices)
        if get_pg_size(self.tp_ep_group) > 1:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), group=self.tp_ep_group
            ).bool()
        first = self.local_expert_indices[0]
        local_map = routing_map[:, first : first + self.num_local_experts]
        local_probs = probs[:, first : first + self.num_local_experts]
        rows = None  # every gathered rank's tokens, per local expert, under a plan
        if planned is not None:
            rows = [get_pg_size(self.tp_ep_group) * planned[e] for e in self.local_expert_indices]
        self.token_idx, permuted_probs = _sort_by_expert(
            local_map, local_probs, None if rows is None else sum(rows)
        )
        self.num_gathered = hidden.size(0)
        self.tokens_per_expert = local_map.sum(dim=0)
        rows = self.tokens_per_expert.tolist() if rows is None else rows  # note: a device sync
        return hidden[self.token_idx], rows, permuted_probs

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        out = combine_rows(expert_output, self.token_idx, self.num_gathered)
        if get_pg_size(self.tp_ep_group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_ep_group)
        return out.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.size(-1))
        num_experts, local = routing_map.size(1), self.num_local_experts
        ep, etp = get_pg_size(self.ep_group), get_pg_size(self.tp_group)
        planned = _planned(routing_map, self.local_expert_indices)
        self.token_idx, permuted_probs = _sort_by_expert(
            routing_map, probs, None if planned is None else sum(planned)
        )
        permuted = hidden[self.token_idx]
        # Every rank's count per expert, over the expert tensor-and-model-parallel group, whose rank
        # is ep_rank * etp + etp_rank (megatron-core's expert grid puts expert TP innermost).
        counts = routing_map.sum(dim=0)
        if ep * etp > 1:
            everyone = [torch.empty_like(counts) for _ in range(ep * etp)]
            dist.all_gather(everyone, counts, group=self.tp_ep_group)
            counts_all = torch.stack(everyone).view(ep, etp, num_experts)
        else:
            counts_all = counts.view(1, 1, num_experts)
        first = self.local_expert_indices[0]
        if planned is None:  # note: two device syncs
            own = counts.tolist()
            mine = counts_all[:, :, first : first + local].tolist()  # [ep][etp][local]
        else:
            own, mine = planned, [[planned[first : first + local]] * etp] * ep
        t0 = get_pg_rank(self.tp_group)
        self.input_splits = [sum(own[r * local : (r + 1) * local]) for r in range(ep)]
        self.output_splits = [sum(mine[r][t0]) for r in range(ep)]
        received = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
        received_probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        self.etp_splits = [sum(sum(mine[r][t]) for r in range(ep)) for t in range(etp)]  # per expert-TP peer
        if etp > 1:
            received = gather_from_sequence_parallel_region(
                received, group=self.tp_group, output_split_sizes=self.etp_splits
            )
            received_probs = gather_from_sequence_parallel_region(
                received_probs, group=self.tp_group, output_split_sizes=self.etp_splits
            )
        # Chunks arrive as (etp peer, ep peer, local expert); the experts want them by local expert.
        self.chunk_sizes = [mine[r][t][e] for t in range(etp) for r in range(ep) for e in range(local)]
        self.sorted_idxs = [
            (t * ep + r) * local + e for e in range(local) for t in range(etp) for r in range(ep)
        ]
        self.sorted_sizes = [self.chunk_sizes[i] for i in self.sorted_idxs]
        self.unsort_idxs = sorted(range(len(self.sorted_idxs)), key=self.sorted_idxs.__getitem__)
        received = sort_chunks_by_idxs(received, self.chunk_sizes, self.sorted_idxs)
        received_probs = sort_chunks_by_idxs(received_probs, self.chunk_sizes, self.sorted_idxs)
        rows = [sum(mine[r][t][e] for r in range(ep) for t in range(etp)) for e in range(local)]
        self.tokens_per_expert = torch.tensor(rows)
        return received, rows, received_probs

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        out = sort_chunks_by_idxs(expert_output, self.sorted_sizes, self.unsort_idxs)
        if get_pg_size(self.tp_group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(
                out, self.tp_group, input_split_sizes=self.etp_splits
            )
        out = all_to_all(self.ep_group, out, self.input_splits, self.output_splits)
        combined = combine_rows(out, self.token_idx, self.hidden_shape.numel() // self.hidden_shape[-1])
        return combined.view(self.hidden_shape)
