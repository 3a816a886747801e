"""One vertical scale shared by every panel of a page, so bars of different layouts compare by
height: its top, its unit and its tick marks."""

from __future__ import annotations

import math
from dataclasses import dataclass

PLOT_HEIGHT = 300  # px of the bars' area in every panel


@dataclass(frozen=True)
class Scale:
    """Bytes -> px: ``top_bytes`` maps to the plot's top, 0 to its bottom."""

    top_bytes: float
    unit: str
    unit_bytes: float
    step_bytes: float

    def px(self, nbytes: float) -> float:
        """Height in px of ``nbytes``."""
        return PLOT_HEIGHT * nbytes / self.top_bytes

    def ticks(self) -> list[float]:
        """Tick values in bytes, 0 to the top."""
        count = int(round(self.top_bytes / self.step_bytes))
        return [i * self.step_bytes for i in range(count + 1)]

    def figure(self, nbytes: float) -> str:
        """``nbytes`` in the scale's unit, 3 significant digits (no exponent below 10^4 units)."""
        value = nbytes / self.unit_bytes
        text = f"{value:#.3g}".rstrip(".")  # '#': 46 shows as 46.0, 3 digits
        return f"{value:.0f}" if "e+" in text else text


def nice_step(span: float, ticks: int = 5) -> float:
    """A 1, 2 or 5 x 10^k step giving about ``ticks`` intervals over ``span``."""
    raw = span / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def shared_scale(panels) -> Scale:
    """The scale whose top clears every panel's bars, measured peaks and capacity line (with room for
    the figures above the bars): GB (1e9 bytes, as the preflight's tables) from 1 GB up, else MB."""
    largest = 0.0
    for panel in panels:
        largest = max(largest, panel.capacity_bytes or 0)
        for s in panel.stages:
            largest = max(largest, s.predicted_peak_bytes, s.measured_peak_bytes or 0)
    largest = largest or 1.0
    unit, unit_bytes = ("GB", 1e9) if largest >= 1e9 else ("MB", 1e6)
    step = nice_step(largest * 1.08)
    top = step * math.ceil(largest * 1.08 / step)
    return Scale(top, unit, unit_bytes, step)


def size_text(nbytes: float) -> str:
    """``nbytes`` for a line of text, in the unit a page of its size uses: "71.24 GB", "3.051 MB"."""
    unit, unit_bytes = ("GB", 1e9) if nbytes >= 1e9 else ("MB", 1e6)
    return f"{nbytes / unit_bytes:.4g} {unit}"
