"""One logged step's metrics: the dict the dashboards and the console line are both built from.

A step's metrics arrive in groups, one per report (the timers, memory, throughput, the learning
rate, the losses, ...), as upstream's training_log makes one call per report to each sink. A group's
``kind`` says what it is, for the sinks whose calls or names differ by kind (sinks.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

SCALARS, TIMERS, LOSSES, TFLOPS, VALIDATION = "scalars", "timers", "losses", "tflops", "validation"
"""Group kinds: ``timers`` are ``<timer>-time``, ``losses`` the step's loss dict, ``tflops`` the
model TFLOP/s per device and in all, ``validation`` an evaluation's ``<loss> validation [ppl]``;
``scalars`` everything else."""


@dataclass(frozen=True)
class MetricGroup:
    values: dict
    """name -> value (a number or a one-element tensor)."""
    vs_samples: bool = False
    """TensorBoard also draws each of these against the consumed samples (``<name> vs samples``)."""
    kind: str = SCALARS


@dataclass
class StepMetrics:
    """name -> value for one step (read with ``[]``, ``in``, ``get``); ``dashboard_groups`` are what
    the sinks get. ``add`` with ``dashboards=False`` keeps a value for the console line only (a
    dashboard flag that is off, or a step between TensorBoard intervals)."""

    step: int
    samples: int | None = None
    """The consumed training samples at this step: the x of TensorBoard's ``vs samples`` curves."""
    dashboard_groups: list[MetricGroup] = field(default_factory=list)
    _values: dict = field(default_factory=dict, init=False, repr=False)

    def add(self, values: Mapping, *, vs_samples: bool = False, kind: str = SCALARS, dashboards=True):
        values = {k: v for k, v in values.items() if v is not None}
        self._values.update(values)
        if values and dashboards:
            self.dashboard_groups.append(MetricGroup(values, vs_samples, kind))

    def add_scalar(self, name: str, value, step: int) -> None:
        """A TensorBoard writer's call, so upstream code given this object as its ``writer`` (MoE's
        track_moe_metrics) adds to the step's metrics: one group per call, as it wrote them."""
        assert step == self.step, f"a metric of step {step} given to step {self.step}'s metrics"
        self.add({name: value})

    def __getitem__(self, name: str):
        return self._values[name]

    def __contains__(self, name: str) -> bool:
        return name in self._values

    def get(self, name: str, default=None):
        return self._values.get(name, default)
