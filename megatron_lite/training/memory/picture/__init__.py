"""The memory picture: each pipeline stage's predicted peak as stacked bars (weights, adapters, grads,
optimizer, activations, temporaries), the measured peak (a run's or the dry run's) beside it, and the
device's capacity and usable lines, on one self-contained HTML page (inline SVG and CSS, no script):

- bars.py: the data (``StageBars``, ``MemoryPanel``) and ``stage_bars_from_predictions``;
- scale.py: the vertical scale every panel of a page shares, so layouts compare by height;
- svg.py: one panel's chart; page.py: the page (``render_memory_page``, ``write_memory_page``);
- logged.py: a run's logged per-stage figures as bars (tools/memory_report.py --html).

tools/memory_report.py --html draws a run's logged figures, the preflight and the planner their
predictions; tools/render_html.py renders a page to PNG in headless chromium.
"""

from megatron_lite.training.memory.picture.bars import (
    PARTS,
    MemoryPanel,
    StageBars,
    prediction_parts,
    stage_bars_from_predictions,
)
from megatron_lite.training.memory.picture.page import render_memory_page, write_memory_page
from megatron_lite.training.memory.picture.scale import size_text

__all__ = [
    "PARTS",
    "MemoryPanel",
    "StageBars",
    "prediction_parts",
    "render_memory_page",
    "size_text",
    "stage_bars_from_predictions",
    "write_memory_page",
]
