"""MegatronOptimizer: AdamW over fp32 master weights with global-norm clipping.

Gradients come from DDP's fp32 ``main_grad`` buffers. With bf16 parameters the optimizer keeps fp32
master copies and its state in fp32, and copies the updated masters back into the bf16 parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_lite.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32, get_grad_norm_fp32
from megatron_lite.core.optimizer.optimizer_config import OptimizerConfig
from megatron_lite.core.tensor_parallel.utils import param_is_not_tensor_parallel_duplicate


def _unwrapped(name: str) -> str:
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def checkpoint_tensors_by_param(model_chunks, state_dict: dict) -> dict:
    """Each trainable parameter's tensor in a checkpoint's ``model`` (one chunk) or ``model0``,
    ``model1``, ... entries, matched by name (``KeyError`` names one that is missing). Frozen ones
    (a PEFT run's base, which its checkpoint does not hold) have no main parameter to start."""
    single = len(model_chunks) == 1 and "model" in state_dict
    keys = ["model"] if single else [f"model{i}" for i in range(len(model_chunks))]
    found = {}
    for key, chunk in zip(keys, model_chunks, strict=True):
        saved = {_unwrapped(k): v for k, v in state_dict[key].items()}
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                found[param] = saved[_unwrapped(name)]
    return found


def has_experts(model_chunks) -> bool:
    """Whether the model is a mixture of experts (its config says; a rank may hold no expert)."""
    return any(getattr(getattr(chunk, "config", None), "num_moe_experts", None) for chunk in model_chunks)


def split_for_norm(params, tensors, tp_rank: int, moe: bool):
    """``(dense, expert)``: ``tensors`` (one per parameter) for a global norm, without tensor-parallel
    duplicates or the tied output layer's copy; routed experts' apart (None without MoE)."""
    counted = [
        (p, t)
        for p, t in zip(params, tensors, strict=True)
        if not getattr(p, "shared", False) and param_is_not_tensor_parallel_duplicate(p, tp_rank)
    ]
    if not moe:
        return [t for _, t in counted], None
    dense = [t for p, t in counted if getattr(p, "allreduce", True)]
    return dense, [t for p, t in counted if not getattr(p, "allreduce", True)]


@dataclass(eq=False)
class MainParam:
    """One fp32 tensor the optimizer steps: ``main`` holds the flat elements ``[start, start +
    main.numel())`` of ``param``, and its updated values go to ``model`` (``main`` itself where the
    model's tensor is fp32)."""

    param: torch.nn.Parameter
    main: torch.Tensor
    model: torch.Tensor
    start: int = 0


class MegatronOptimizer:
    """AdamW over fp32 main parameters, clipped by the global gradient norm. The base of
    DistributedOptimizer, as upstream's hierarchy: a subclass says what its main parameters are
    (``_main_params``), which gradients they step on (``_gradients``), over which more groups the
    norm adds up (``_norm_groups``) and what follows a step (``_after_step``); the AdamW groups,
    the norms, clipping, the step and the state's bytes are here."""

    # Whether AdamW keeps a group without parameters (the distributed optimizer's shards may hold no
    # matrix, or no bias, and every rank must still see the same groups).
    keeps_empty_groups = False

    def __init__(
        self,
        config: OptimizerConfig,
        model_chunks,
        *,
        model_parallel_group=None,
        tp_group=None,
        foreach=None,
        expert_model_parallel_group=None,
    ):
        """``foreach``: AdamW's implementation, None for PyTorch's choice (the per-tensor loop on the
        CPU, foreach on CUDA); the preflight's dry run of a GPU job sets True, as CUDA would.
        ``expert_model_parallel_group``: the ranks holding different experts (expert TP x EP x PP),
        over which a MoE model's expert gradient norms add up."""
        self.config = config
        self.model_chunks = model_chunks
        self.model_parallel_group = model_parallel_group
        self.expert_model_parallel_group = expert_model_parallel_group
        self.has_experts = has_experts(model_chunks)
        self.tp_rank = 0 if tp_group is None else dist.get_rank(tp_group)
        self.units: list[MainParam] = self._main_params()
        groups = [
            {
                "params": [u.main for u in self.units if u.param.ndim >= 2],
                "weight_decay": config.weight_decay,
                "wd_mult": 1.0,
            },
            {"params": [u.main for u in self.units if u.param.ndim < 2], "weight_decay": 0.0, "wd_mult": 0.0},
        ]
        # A rank with nothing to train (a pipeline stage without adapters, in a LoRA run) keeps both
        # groups empty: it still steps, and joins the norm's collectives, with the others.
        keep_empty = self.keeps_empty_groups or not self.units
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"] or keep_empty],
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            foreach=foreach,
        )

    # What a subclass decides ------------------------------------------------------------------

    def _main_params(self) -> list[MainParam]:
        """Every trainable parameter whole: fp32 ones are their own main parameters, lower-precision
        ones get fp32 copies."""
        params = [p for chunk in self.model_chunks for p in chunk.parameters() if p.requires_grad]
        return [
            MainParam(p, p if p.dtype == torch.float32 else p.detach().float().requires_grad_(True), p)
            for p in params
        ]

    def _gradients(self) -> list[torch.Tensor]:
        """The gradient each main parameter steps on: DDP's fp32 ``main_grad`` (a copy for a master,
        so clipping leaves the buffer alone)."""
        return [u.param.main_grad if u.main is u.param else u.param.main_grad.clone() for u in self.units]

    def _norm_groups(self) -> dict:
        """More groups the norm adds up over, beside the model-parallel ones (get_grad_norm_fp32's)."""
        return {}

    def _after_step(self) -> None:
        """What follows an applied update (the distributed optimizer all-gathers the parameters)."""

    # The step ----------------------------------------------------------------------------------

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def get_loss_scale(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def _norm(self, tensors) -> float:
        """L2 norm of one tensor per main parameter (each logical parameter once). Collective over the
        model-parallel group, the expert one for a MoE model, and ``_norm_groups``'."""
        params = [u.param for u in self.units]
        dense, expert = split_for_norm(params, tensors, self.tp_rank, self.has_experts)
        return get_grad_norm_fp32(
            dense,
            self.model_parallel_group,
            expert_grads=expert,
            expert_model_parallel_group=self.expert_model_parallel_group,
            **self._norm_groups(),
        )

    def get_params_norm(self) -> float:
        """L2 norm of the fp32 main parameters over all model-parallel ranks. Collective as ``_norm``."""
        return self._norm([u.main.detach() for u in self.units])

    @torch.no_grad()
    def step(self) -> tuple[bool, float, None]:
        """Clip and apply one update. Collective as ``_norm`` (the grad norm), then ``_after_step``.

        Returns ``(update_successful, grad_norm, num_zeros_in_grad)``; a non-finite gradient norm skips
        the update on every rank, so a single bad batch cannot poison the weights.
        """
        grads = self._gradients()
        for u, grad in zip(self.units, grads, strict=True):
            u.main.grad = grad
        grad_norm = self._norm(grads)
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        if self.config.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32(grads, self.config.clip_grad, grad_norm)
        self.optimizer.step()
        for u in self.units:
            if u.main is not u.model:
                u.model.copy_(u.main)
        self._after_step()
        return True, grad_norm, None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the main parameters' gradients; a parameter's own gradient lives in DDP's buffer."""
        for u in self.units:
            if u.main is not u.param:
                u.main.grad = None

    def optimizer_state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: AdamW's moments and the fp32 main parameters that are
        not the model's own tensors, measured from the tensors."""
        total = sum(
            t.numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        )
        return total + sum(u.main.numel() * 4 for u in self.units if u.main is not u.model)

    @torch.no_grad()
    def reload_model_params(self, state_dict: dict | None = None) -> None:
        """Start the fp32 main parameters again from the weights, after these changed outside the
        optimizer (a checkpoint loaded without its optimizer state). With ``state_dict`` (a
        checkpoint's), from its tensors instead, which keeps precision a bf16 model rounds away."""
        sources = checkpoint_tensors_by_param(self.model_chunks, state_dict) if state_dict else {}
        for u in self.units:
            if u.main is not u.param:
                u.main.copy_(sources.get(u.param, u.param))

    def state_dict(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if any(u.main is not u.param for u in self.units):
            state["fp32_from_fp16_params"] = [u.main.detach().clone() for u in self.units]
        return state

    def load_state_dict(self, state: dict) -> None:
        """AdamW's state, and the fp32 main weights when ``state`` holds them. A state saved by an fp32
        run has none (its weights were its main weights): the caller then calls reload_model_params."""
        self.optimizer.load_state_dict(state["optimizer"])
        if "fp32_from_fp16_params" in state:
            with torch.no_grad():
                for u, saved in zip(self.units, state["fp32_from_fp16_params"], strict=True):
                    u.main.copy_(saved)
                    u.param.copy_(saved)


# Upstream's mixed-precision optimizer class, at its upstream path (megatron.core.optimizer.optimizer).
from megatron_lite.core.optimizer.float16_optimizer import Float16OptimizerWithFloat16Params  # noqa: E402, F401
