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
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_lite.core.tensor_parallel.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _sort_by_expert(routing_map: torch.Tensor, probs: torch.Tensor):
    """``(token indices, their probabilities)`` of every (token, expert) pair in ``routing_map``
    [tokens, experts], ordered by expert, then token."""
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
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
        if _size(self.tp_ep_group) > 1:
            hidden = gather_from_sequence_parallel_region(hidden, group=self.tp_ep_group)
            probs = gather_from_sequence_parallel_region(probs, group=self.tp_ep_group)
            routing_map = gather_from_sequence_parallel_region(
                routing_map.to(torch.uint8), group=self.tp_ep_group
            ).bool()
        first = self.local_expert_indices[0]
        local_map = routing_map[:, first : first + self.num_local_experts]
        local_probs = probs[:, first : first + self.num_local_experts]
        self.token_idx, permuted_probs = _sort_by_expert(local_map, local_probs)
        self.num_gathered = hidden.size(0)
        self.tokens_per_expert = local_map.sum(dim=0)
        return hidden[self.token_idx], self.tokens_per_expert.tolist(), permuted_probs

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        out = expert_output.new_zeros((self.num_gathered, expert_output.size(-1)))
        out = out.index_add(0, self.token_idx, expert_output)
        if _size(self.tp_ep_group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(out, self.tp_ep_group)
        return out.view(self.hidden_shape)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    def token_permutation(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_states.size(-1))
        num_experts = routing_map.size(1)
        ep, etp = _size(self.ep_group), _size(self.tp_group)
        self.token_idx, permuted_probs = _sort_by_expert(routing_map, probs)
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
        mine = counts_all[:, :, first : first + self.num_local_experts].cpu()  # [ep, etp, local]
        t0 = _rank(self.tp_group)
        self.input_splits = counts.view(ep, self.num_local_experts).sum(dim=1).tolist()
        self.output_splits = mine[:, t0].sum(dim=1).tolist()
        received = all_to_all(self.ep_group, permuted, self.output_splits, self.input_splits)
        received_probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
        self.etp_splits = mine.sum(dim=(0, 2)).tolist()  # rows from each expert-TP peer
        if etp > 1:
            received = gather_from_sequence_parallel_region(
                received, group=self.tp_group, output_split_sizes=self.etp_splits
            )
            received_probs = gather_from_sequence_parallel_region(
                received_probs, group=self.tp_group, output_split_sizes=self.etp_splits
            )
        # Chunks arrive as (etp peer, ep peer, local expert); the experts want them by local expert.
        by_source = mine.permute(1, 0, 2)  # [etp, ep, local]
        self.chunk_sizes = by_source.reshape(-1).tolist()
        order = torch.arange(len(self.chunk_sizes)).view(etp, ep, self.num_local_experts)
        self.sorted_idxs = order.permute(2, 0, 1).reshape(-1).tolist()
        self.sorted_sizes = [self.chunk_sizes[i] for i in self.sorted_idxs]
        self.unsort_idxs = torch.tensor(self.sorted_idxs).argsort().tolist()
        received = sort_chunks_by_idxs(received, self.chunk_sizes, self.sorted_idxs)
        received_probs = sort_chunks_by_idxs(received_probs, self.chunk_sizes, self.sorted_idxs)
        self.tokens_per_expert = mine.sum(dim=(0, 1))
        return received, self.tokens_per_expert.tolist(), received_probs

    def token_unpermutation(self, expert_output: torch.Tensor) -> torch.Tensor:
        out = sort_chunks_by_idxs(expert_output, self.sorted_sizes, self.unsort_idxs)
        if _size(self.tp_group) > 1:
            out = reduce_scatter_to_sequence_parallel_region(
                out, self.tp_group, input_split_sizes=self.etp_splits
            )
        out = all_to_all(self.ep_group, out, self.input_splits, self.output_splits)
        combined = out.new_zeros((self.hidden_shape.numel() // self.hidden_shape[-1], out.size(-1)))
        combined = combined.index_add(0, self.token_idx, out)
        return combined.view(self.hidden_shape)
