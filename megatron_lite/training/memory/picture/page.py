"""The memory page: panels of stage bars on one shared scale, a legend and notes, as one HTML file with
its SVG and CSS inline (no script, font or stylesheet fetched: it opens offline, attached to an issue
or in a CI artifact)."""

from __future__ import annotations

from html import escape

from megatron_lite.training.memory.picture.bars import PARTS
from megatron_lite.training.memory.picture.scale import shared_scale
from megatron_lite.training.memory.picture.svg import (
    CAPACITY_COLOUR,
    COLOURS,
    MEASURED_COLOUR,
    USABLE_COLOUR,
    render_panel_svg,
)
from megatron_lite.utils.atomic_io import atomic_write_bytes

PAGE_WIDTH = 1200  # px of content: fits a 1280 px window with its margins and a scrollbar
GAP = 16

STYLE = """
body { margin: 20px; font-family: "DejaVu Sans", Arial, sans-serif; color: #111; background: #fff; }
h1 { font-size: 20px; margin: 0 0 8px 0; }
.legend { font-size: 13px; margin: 0 0 12px 0; display: flex; flex-wrap: wrap; gap: 6px 16px; align-items: center; }
.swatch { display: inline-block; width: 14px; height: 14px; vertical-align: -2px; margin-right: 5px; }
.line { display: inline-block; width: 22px; height: 0; vertical-align: 4px; margin-right: 5px; }
.panels { display: flex; flex-wrap: wrap; gap: 16px; }
figure { margin: 0; border: 1px solid #ddd; border-radius: 4px; padding: 8px 8px 6px 8px; }
figcaption { overflow-wrap: anywhere; font-size: 15px; font-weight: bold; margin: 0 0 2px 4px; }
.lines { font-size: 12px; margin: 2px 4px 0 4px; padding: 0; list-style: none; color: #333; overflow-wrap: anywhere; }
.lines li { margin: 1px 0; }
.notes { font-size: 12px; color: #444; margin-top: 12px; max-width: 1200px; }
.notes p { margin: 3px 0; }
"""


def _columns(panels) -> int:
    """Panels per row: one wide chart alone; a plan's candidates two abreast, three when each has at
    most four stages (so a stage's bars keep room for their figures)."""
    if len(panels) <= 1:
        return 1
    most = max(len(p.stages) for p in panels)
    return 3 if len(panels) >= 5 and most <= 4 else 2


def _legend(panels) -> str:
    present = {name for p in panels for s in p.stages for name in s.parts}
    items = ["<b>predicted peak, by part:</b>"]
    for name in PARTS:
        if name in present:
            fill = COLOURS[name][0]
            items.append(f'<span><span class="swatch" style="background:{fill}"></span>{name}</span>')
    labels = sorted({s.measured_label for p in panels for s in p.stages if s.measured_peak_bytes is not None})
    for label in labels:
        what = "measured on fake tensors" if label == "dry run" else "the run's allocated peak"
        items.append(
            f'<span><span class="swatch" style="background:{MEASURED_COLOUR}"></span>'
            f"{escape(label)} ({what})</span>"
        )
    if any(p.capacity_bytes is not None for p in panels):
        items.append(
            f'<span><span class="line" style="border-top:2px solid {CAPACITY_COLOUR}"></span>device capacity</span>'
        )
        items.append(
            f'<span><span class="line" style="border-top:2px dashed {USABLE_COLOUR}"></span>usable</span>'
        )
    return '<div class="legend">' + "".join(items) + "</div>"


def render_memory_page(title: str, panels: list, notes: tuple[str, ...] = ()) -> str:
    """The page for ``panels`` (MemoryPanel list), all drawn on one scale, under ``title``, with
    ``notes`` (lines of text) at the bottom. Self-contained HTML; every text escaped."""
    scale = shared_scale(panels)
    columns = _columns(panels)
    # Each figure's border (2) and padding (16) inside its share of the row, 2 px to spare.
    width = (PAGE_WIDTH - GAP * (columns - 1)) // columns - 20
    figures = []
    for panel in panels:
        lines = "".join(f"<li>{escape(line)}</li>" for line in panel.lines)
        figures.append(
            # A fixed width: long text lines wrap inside the panel instead of widening it off the row.
            f'<figure class="panel" style="width:{width}px"><figcaption>{escape(panel.title)}</figcaption>\n'
            f"{render_panel_svg(panel, scale, width)}\n"
            + (f'<ul class="lines">{lines}</ul>' if lines else "")
            + "</figure>"
        )
    notes_html = "".join(f"<p>{escape(n)}</p>" for n in notes)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8"/>'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head>\n<body>\n"
        f"<h1>{escape(title)}</h1>\n{_legend(panels)}\n"
        f'<div class="panels">\n'
        + "\n".join(figures)
        + "\n</div>\n"
        + (f'<div class="notes">{notes_html}</div>\n' if notes_html else "")
        + "</body></html>\n"
    )


def write_memory_page(path: str, title: str, panels: list, notes: tuple[str, ...] = ()) -> None:
    """:func:`render_memory_page` written to ``path`` atomically (a reader never sees half a page)."""
    data = render_memory_page(title, panels, notes).encode("utf-8")
    atomic_write_bytes(path, lambda f: f.write(data), len(data))
