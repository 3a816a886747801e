"""A rank's routed experts, as megatron.core.transformer.moe.experts names them.

``TEGroupedMLP`` (``--moe-grouped-gemm``) holds local expert i's weights as ``linear_fc1.weight<i>``
and ``linear_fc2.weight<i>`` and runs all local experts as one grouped GEMM per projection
(``torch.nn.functional.grouped_mm``); ``SequentialMLP`` holds one MLP per local expert
(``local_experts.<i>.linear_fc1.weight``) and runs them one after the other. Both take the tokens
already sorted by expert, scale each expert's hidden activation by the token's routing probability
(as upstream: before fc2, so the weighted outputs add up in the combine), and do no communication:
the token dispatcher moves tokens between ranks. Under expert tensor parallelism each rank holds a
slice of every local expert (fc1 by rows, gated as [gate slice; value slice], fc2 by columns) and
returns partial outputs that the dispatcher's combine sums.

Every expert is drawn from its own generator keyed by its global index, from the full-size master
weight, so a model starts the same at any expert-parallel and expert-tensor-parallel size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.fusions.fused_bias_swiglu import fuses, weighted_swiglu
from megatron_lite.core.process_group_utils import get_pg_rank, get_pg_size, kernel_device_type
from megatron_lite.core.tensor_parallel.utils import init_partition_, set_tensor_model_parallel_attributes
from megatron_lite.core.transformer.transformer_config import TransformerConfig
from megatron_lite.core.utils import seeded_init


def expert_parameter(shape, config, init_method, partition_dim, etp_rank, etp_size, stride=1) -> nn.Parameter:
    """One expert weight slice (``init_method`` None: a bias, zeroed), reduced over the expert
    data-parallel ranks (``allreduce`` False) rather than the dense ones."""
    weight = nn.Parameter(torch.empty(*shape, dtype=config.params_dtype))
    if config.perform_initialization:
        if init_method is None:
            with torch.no_grad():
                weight.zero_()
        else:
            init_partition_(weight, init_method, partition_dim, etp_rank, etp_size, stride)
    # Marked split even where it is not (fc2's bias): expert biases need expert TP 1, so no rank holds
    # a duplicate, and every rank's experts count in the gradient norm.
    set_tensor_model_parallel_attributes(weight, True, 0 if partition_dim is None else partition_dim, stride)
    weight.allreduce = False
    return weight


class ExpertLinear(nn.Module):
    """``weight<i>`` (and ``bias<i>``) for experts i in ``names``; ``out`` x ``in`` per rank."""

    def __init__(
        self, config, in_features, out_features, names, *, seed, init, partition_dim, etp, stride, bias
    ):
        super().__init__()
        etp_rank, etp_size = etp
        for suffix, key in names:
            with seeded_init(seed, key):
                self.register_parameter(
                    f"weight{suffix}",
                    expert_parameter(
                        (out_features, in_features), config, init, partition_dim, etp_rank, etp_size, stride
                    ),
                )
            if bias:
                bias_dim = 0 if partition_dim == 0 else None
                self.register_parameter(
                    f"bias{suffix}",
                    expert_parameter((out_features,), config, None, bias_dim, etp_rank, etp_size, stride),
                )
        self.suffixes = [suffix for suffix, _ in names]
        self.has_bias = bias
        self.config, self.etp = config, etp  # read by an adapter wrapping this layer (LoRA)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int] | None = None, add_bias: bool = True):
        """``x`` (rows sorted by expert) times each local expert's ``weight.T``, plus its bias when
        ``add_bias`` (fc2's is added by the caller, scaled by the routing probability). One expert's
        layer (SequentialMLP's) is a plain GEMM. A module call, so an adapter can wrap it."""
        biases = self.biases() if add_bias else None
        if self.suffixes == [""]:
            return F.linear(x, self.weight.to(x.dtype), biases[0].to(x.dtype) if biases else None)
        return grouped_linear(x, self.weights(), biases, tokens_per_expert)

    def weights(self) -> list[nn.Parameter]:
        return [getattr(self, f"weight{s}") for s in self.suffixes]

    def biases(self) -> list[nn.Parameter] | None:
        return [getattr(self, f"bias{s}") for s in self.suffixes] if self.has_bias else None


def _aligned(*tensors: torch.Tensor) -> bool:
    """grouped_mm needs rows that are multiples of 16 bytes."""
    return all(
        t.shape[-1] * t.element_size() % 16 == 0 and t.shape[-2] * t.element_size() % 16 == 0 for t in tensors
    )


def _grouped(*tensors: torch.Tensor) -> bool:
    """Whether one grouped GEMM can take these: on the CPU any float; CUDA's kernels take bf16 (other
    dtypes there loop over the experts)."""
    x = tensors[0]
    device = kernel_device_type(x)  # the dry run of a GPU job takes CUDA's path
    device_ok = device == "cpu" or (device == "cuda" and x.dtype == torch.bfloat16)
    return device_ok and _aligned(*tensors)


def _offsets(rows: list[int], device) -> torch.Tensor:
    return torch.tensor(rows, device=device).cumsum(0).to(torch.int32)


class GroupedLinear(torch.autograd.Function):
    """``x`` (rows sorted by expert) times each expert's ``weight.T``. Saves the input and the weights
    themselves, not the stacked copy a grouped GEMM reads: that copy lives for one GEMM, in forward and
    again in backward (autograd would otherwise keep a copy of every local expert's weights per layer
    and microbatch until backward). Computes only the gradients autograd needs: frozen weights (LoRA)
    get no weight gradient and their input is not kept for one; an input that needs no gradient
    gets none."""

    @staticmethod
    def forward(ctx, x, rows, *weights):
        ctx.rows = rows
        ctx.wgrad = any(ctx.needs_input_grad[2:])
        ctx.save_for_backward(x if ctx.wgrad else None, *weights)
        ws = [w.to(x.dtype) for w in weights]
        if sum(rows) == 0:
            return x.new_zeros((0, ws[0].size(0)))
        if _grouped(x, ws[0]):
            return F.grouped_mm(x, torch.stack(ws).transpose(1, 2), offs=_offsets(rows, x.device))
        return torch.cat([part @ w.t() for part, w in zip(x.split(rows), ws, strict=True)])

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        rows, grad = ctx.rows, grad.contiguous()
        dgrad, wgrads = ctx.needs_input_grad[0], ctx.needs_input_grad[2:]
        ws = [w.to(grad.dtype) for w in weights]
        if sum(rows) == 0:  # no token reached these experts: nothing to multiply (grouped_mm's
            # kernels reject, or on some GPUs mishandle, all-empty groups)
            grad_x = grad.new_zeros((0, ws[0].size(1))) if dgrad else None
            return grad_x, None, *(torch.zeros_like(w) if need else None for w, need in zip(weights, wgrads))
        grad_x, grad_w = None, [None] * len(weights)
        if _grouped(grad, ws[0]) and (x is None or _aligned(x)):
            offsets = _offsets(rows, grad.device)
            if dgrad:
                grad_x = F.grouped_mm(grad, torch.stack(ws), offs=offsets)
            if ctx.wgrad:
                grad_w = F.grouped_mm(grad.t().contiguous(), x, offs=offsets).unbind(0)  # [experts, out, in]
        else:
            if dgrad:
                grad_x = torch.cat([g @ w for g, w in zip(grad.split(rows), ws, strict=True)])
            if ctx.wgrad:
                grad_w = [g.t() @ part for g, part in zip(grad.split(rows), x.split(rows), strict=True)]
        grad_w = [g.to(w.dtype) if need else None for g, w, need in zip(grad_w, weights, wgrads, strict=True)]
        return grad_x, None, *grad_w


def grouped_linear(x: torch.Tensor, weights, biases, tokens_per_expert: list[int]) -> torch.Tensor:
    """``x`` (rows sorted by expert, ``tokens_per_expert[i]`` for expert i) times each expert's own
    ``weight.T`` (plus its bias): one grouped GEMM when the shapes allow it, else one GEMM per expert."""
    out = GroupedLinear.apply(x, list(tokens_per_expert), *weights)
    return out if biases is None else out + bias_rows(biases, tokens_per_expert, out)


def bias_rows(biases, tokens_per_expert: list[int], like: torch.Tensor) -> torch.Tensor:
    """Each row's expert bias, rows sorted by expert, in ``like``'s dtype and device."""
    # output_size: the rows are known, so no device sync (and fake tensors, without values, take it)
    return torch.repeat_interleave(
        torch.stack(biases).to(like.dtype),
        torch.tensor(tokens_per_expert, device=like.device),
        dim=0,
        output_size=sum(tokens_per_expert),
    )


def _upstream_arguments(num_local_experts, config, submodules=None, pg_collection=None, name=None):
    """megatron_lite's arguments for upstream's ``(num_local_experts, config, submodules,
    pg_collection)``: the experts of this expert-parallel rank (groups parallel_state's when None),
    drawn as layer 1's."""
    from megatron_lite.core.transformer.moe.moe_utils import get_default_pg_collection

    pg = pg_collection or get_default_pg_collection()
    offset = get_pg_rank(pg.ep) * num_local_experts
    etp = (get_pg_rank(pg.expt_tp), get_pg_size(pg.expt_tp))
    return (config, num_local_experts, offset), dict(layer_number=1, etp=etp, seed=1234)


class _ExpertsBase(nn.Module):
    """Built as megatron_lite's ``(config, num_local_experts, local_expert_offset, layer_number=,
    etp=, seed=)``, or with upstream's signature ``(num_local_experts, config, submodules,
    pg_collection=None)``, which also makes forward return upstream's ``(output, bias)`` pair."""

    def __init__(self, *args, **kwargs):
        upstream = isinstance(args[0], int)
        if upstream:
            args, kwargs = _upstream_arguments(*args, **kwargs)
        self._setup(*args, **kwargs)
        self.returns_bias = upstream

    def _output(self, out: torch.Tensor):
        return (out, None) if self.returns_bias else out

    def _setup(
        self,
        config: TransformerConfig,
        num_local_experts: int,
        local_expert_offset: int,
        *,
        layer_number,
        etp,
        seed,
    ):
        nn.Module.__init__(self)
        self.seed = seed
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_offset = local_expert_offset
        self.layer_number = layer_number
        self.etp = etp  # (rank, size) in the expert tensor-parallel group
        gated = config.gated_linear_unit
        self.ffn = config.moe_ffn_hidden_size // etp[1]
        self.fc1_out = self.ffn * (2 if gated else 1)

    def _linear(self, which: str, experts):
        c = self.config
        names = [(suffix, f"layer {self.layer_number - 1} expert {e} {which}") for suffix, e in experts]
        if which == "fc1":
            return ExpertLinear(
                c, c.hidden_size, self.fc1_out, names, seed=self.seed, init=c.init_method, partition_dim=0, etp=self.etp,
                stride=2 if c.gated_linear_unit else 1, bias=c.add_bias_linear,
            )  # fmt: skip
        return ExpertLinear(
            c, self.ffn, c.hidden_size, names, seed=self.seed, init=c.output_layer_init_method, partition_dim=1, etp=self.etp,
            stride=1, bias=c.add_bias_linear,
        )  # fmt: skip

    def activation(self, intermediate: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """The activation (gated: act(gate) * value), then each row times its routing probability."""
        if fuses(self.config):  # saving only fc1's output and the probabilities, as megatron-core's
            return weighted_swiglu(intermediate, probs.unsqueeze(-1).to(intermediate.dtype))
        if self.config.gated_linear_unit:
            gate, value = intermediate.chunk(2, dim=-1)
            intermediate = self.config.activation_func(gate) * value
        else:
            intermediate = self.config.activation_func(intermediate)
        return intermediate * probs.unsqueeze(-1).to(intermediate.dtype)


class TEGroupedMLP(_ExpertsBase):
    """The local experts as two grouped projections (``linear_fc1.weight<i>``, ``linear_fc2.weight<i>``)."""

    def _setup(self, config, num_local_experts, local_expert_offset, *, layer_number, etp, seed):
        super()._setup(
            config, num_local_experts, local_expert_offset, layer_number=layer_number, etp=etp, seed=seed
        )
        experts = [(str(i), local_expert_offset + i) for i in range(num_local_experts)]
        self.linear_fc1 = self._linear("fc1", experts)
        self.linear_fc2 = self._linear("fc2", experts)

    def forward(
        self, hidden: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor
    ) -> torch.Tensor:
        fc1 = self.linear_fc1(hidden, tokens_per_expert)
        intermediate = self.activation(fc1, probs)
        # fc2's bias is scaled by the probability too: the whole expert output is weighted.
        out = self.linear_fc2(intermediate, tokens_per_expert, add_bias=False)
        if self.linear_fc2.has_bias:
            bias = bias_rows(self.linear_fc2.biases(), tokens_per_expert, out)
            out = out + bias * probs.unsqueeze(-1).to(out.dtype)
        return self._output(out)


class _ExpertMLP(nn.Module):
    """One expert of SequentialMLP: ``linear_fc1.weight`` and ``linear_fc2.weight``."""

    def __init__(self, parent: _ExpertsBase, expert: int):
        super().__init__()
        self.linear_fc1 = parent._linear("fc1", [("", expert)])
        self.linear_fc2 = parent._linear("fc2", [("", expert)])


class SequentialMLP(_ExpertsBase):
    """The local experts as ``local_experts.<i>``, one MLP each, run one after the other."""

    def _setup(self, config, num_local_experts, local_expert_offset, *, layer_number, etp, seed):
        super()._setup(
            config, num_local_experts, local_expert_offset, layer_number=layer_number, etp=etp, seed=seed
        )
        self.local_experts = nn.ModuleList(
            _ExpertMLP(self, local_expert_offset + i) for i in range(num_local_experts)
        )

    def forward(
        self, hidden: torch.Tensor, tokens_per_expert: list[int], probs: torch.Tensor
    ) -> torch.Tensor:
        outputs = []
        for expert, x, p in zip(
            self.local_experts, hidden.split(tokens_per_expert), probs.split(tokens_per_expert)
        ):
            fc2 = expert.linear_fc2
            intermediate = self.activation(expert.linear_fc1(x), p)
            out = fc2(intermediate, add_bias=False)
            if fc2.has_bias:
                out = out + fc2.bias.to(out.dtype) * p.unsqueeze(-1).to(out.dtype)
            outputs.append(out)
        return self._output(torch.cat(outputs) if outputs else hidden.new_empty((0, self.config.hidden_size)))
