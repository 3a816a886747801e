"""Forward step callables, and giving the ones that want it the GlobalState.

A forward step is called by the schedules as ``f(data_iterator, model)``. Megatron-Bridge's own steps
take the run's state first, ``f(state, data_iterator, model[, return_schedule_plan])``; the training
loop wraps such a step once with ``prepare_forward_step_func`` (a ``partial`` holding the state
object, so later changes to the state are seen), and leaves a two-argument step as it is. Functors
(objects with ``__call__``) are inspected through their ``__call__`` and keep their own state.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any, Protocol

import torch

LossReduced = dict[str, torch.Tensor]
"""What a loss function reports for logging, per microbatch."""


class TwoArgForwardStep(Protocol):
    def __call__(self, data_iterator, model) -> tuple[torch.Tensor, partial]: ...


class StateForwardStep(Protocol):
    def __call__(
        self, state, data_iterator, model, return_schedule_plan: bool = False
    ) -> tuple[torch.Tensor, partial]: ...


ForwardStepCallable = TwoArgForwardStep | StateForwardStep


def _is_global_state_annotation(annotation: Any) -> bool:
    if annotation is inspect.Parameter.empty:
        return False
    if isinstance(annotation, str):
        return "GlobalState" in annotation
    return getattr(annotation, "__name__", None) == "GlobalState"


def needs_global_state_injection(forward_step_func) -> bool:
    """Whether the step wants the state: a parameter annotated ``GlobalState``, or (unannotated) a
    first parameter named ``state`` or ``global_state``."""
    parameters = list(inspect.signature(forward_step_func).parameters.values())
    if any(_is_global_state_annotation(p.annotation) for p in parameters):
        return True
    return bool(parameters) and parameters[0].name in ("state", "global_state")


def maybe_inject_state(forward_step_func, state, needs_injection: bool | None = None):
    """``partial(forward_step_func, state)`` if the step wants the state, else the step itself."""
    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func, state):
    """Inspect once and inject the state if wanted; call at the start of training or evaluation."""
    return maybe_inject_state(forward_step_func, state, needs_global_state_injection(forward_step_func))
