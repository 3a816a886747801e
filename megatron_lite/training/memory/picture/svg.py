"""One panel's chart as inline SVG, written by hand: per stage a stacked bar of the predicted peak's
parts and, beside it, the measured peak; the device capacity and usable lines; GB figures on the bars
and a <title> per bar with every figure (shown on hover, read by screen readers)."""

from __future__ import annotations

from html import escape

from megatron_lite.training.memory.picture.bars import PARTS
from megatron_lite.training.memory.picture.scale import PLOT_HEIGHT, Scale

# Paul Tol's colour-blind-safe palette; the text colour on each keeps contrast.
COLOURS = {
    "weights": ("#4477aa", "#ffffff"),
    "adapters": ("#66ccee", "#000000"),
    "grads": ("#228833", "#ffffff"),
    "optimizer": ("#ccbb44", "#000000"),
    "activations": ("#ee6677", "#000000"),
    "temporaries": ("#aa3377", "#ffffff"),
}
MEASURED_COLOUR = "#7a7a7a"
CAPACITY_COLOUR = "#222222"
USABLE_COLOUR = "#d55e00"
OVER_COLOUR = "#c00000"  # a peak above the usable line

TOP, BOTTOM, LEFT, RIGHT = 26, 44, 46, 96  # margins around the plot, px
BASE = TOP + PLOT_HEIGHT  # the y of 0 bytes
LABEL_WIDTH = 24  # px a 3-digit figure needs at 10 px
FONT = 'font-family="DejaVu Sans, Arial, sans-serif"'


def _text(x, y, s, size=11, anchor="middle", fill="#000", bold=False, halo=False) -> str:
    weight = ' font-weight="bold"' if bold else ""
    # A white outline under the glyphs keeps a figure readable where a line crosses it.
    weight += ' stroke="#fff" stroke-width="3" paint-order="stroke"' if halo else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{fill}"{weight}>'
        f"{escape(s)}</text>"
    )


def _rect(x, y, w, h, fill, attrs="") -> str:
    return f'<rect{attrs} x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="{fill}"/>'


def _bar_widths(panel, plot_width: float) -> tuple[float, float, float]:
    """(group width, predicted bar width, measured bar width) for the panel's stage count."""
    group = plot_width / max(len(panel.stages), 1)
    measured = any(s.measured_peak_bytes is not None for s in panel.stages)
    inner = group * 0.8
    bar = min(inner / 2 if measured else inner, 64.0)
    return group, bar, (bar * 0.75 if measured else 0.0)


def _axis(scale: Scale, plot_width: float) -> list[str]:
    out = [_text(LEFT - 6, TOP - 10, scale.unit, anchor="end", bold=True)]
    for tick in scale.ticks():
        y = BASE - scale.px(tick)
        out.append(
            f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_width:.1f}" y2="{y:.1f}" stroke="#e3e3e3"/>'
        )
        out.append(_text(LEFT - 6, y + 4, f"{tick / scale.unit_bytes:g}", size=10, anchor="end", fill="#444"))
    return out


def _predicted_bar(s, x: float, width: float, scale: Scale, over: bool, labels: list[str]) -> list[str]:
    """The stacked parts (their figures inside where they fit); the peak's figure goes to ``labels``."""
    peak = s.predicted_peak_bytes
    title = f"stage {s.stage} predicted peak {scale.figure(peak)} {scale.unit}: " + ", ".join(
        f"{name} {scale.figure(v)}" for name, v in s.parts.items()
    )
    out = [f'<g class="predicted" data-stage="{s.stage}" data-bytes="{peak}"><title>{escape(title)}</title>']
    y = BASE
    for name in PARTS:
        if (nbytes := s.parts.get(name)) is None:
            continue
        h = scale.px(nbytes)
        y -= h
        fill, ink = COLOURS[name]
        out.append(_rect(x, y, width, h, fill, f' class="part" data-part="{name}" data-bytes="{nbytes}"'))
        if h >= 12 and width >= LABEL_WIDTH + 2:
            out.append(_text(x + width / 2, y + h / 2 + 4, scale.figure(nbytes), size=10, fill=ink))
    if width >= LABEL_WIDTH - 2:
        colour = OVER_COLOUR if over else "#000"
        labels.append(_text(x + width / 2, y - 4, scale.figure(peak), fill=colour, bold=True, halo=True))
    out.append("</g>")
    return out


def _measured_bar(s, x: float, width: float, scale: Scale, labels: list[str]) -> list[str]:
    """The measured peak's bar; its figure goes to ``labels``."""
    nbytes = s.measured_peak_bytes
    h = scale.px(nbytes)
    diff = f" (prediction {100 * (s.predicted_peak_bytes / nbytes - 1):+.1f}%)" if s.parts and nbytes else ""
    title = f"stage {s.stage} {s.measured_label}: measured allocated peak {scale.figure(nbytes)} {scale.unit}{diff}"
    label = escape(s.measured_label)
    out = [
        f'<g class="measured" data-stage="{s.stage}" data-bytes="{nbytes}" data-label="{label}">'
        f"<title>{escape(title)}</title>",
        _rect(x, BASE - h, width, h, MEASURED_COLOUR),
    ]
    if width >= LABEL_WIDTH - 2:
        labels.append(
            _text(x + width / 2, BASE - h - 4, scale.figure(nbytes), size=10, fill="#333", halo=True)
        )
    out.append("</g>")
    return out


def _line(kind, nbytes, label, plot_width, colour, dash, y, label_y) -> list[str]:
    return [
        f'<line class="{kind}" data-bytes="{nbytes}" x1="{LEFT}" y1="{y:.2f}" x2="{LEFT + plot_width:.2f}" '
        f'y2="{y:.2f}" stroke="{colour}" stroke-width="2"{dash}><title>{escape(label)}</title></line>',
        _text(LEFT + plot_width + 6, label_y + 4, label, anchor="start", fill=colour),
    ]


def _capacity_lines(panel, scale: Scale, plot_width: float) -> list[str]:
    if panel.capacity_bytes is None:
        return []
    cap, usable = panel.capacity_bytes, panel.usable_bytes
    cap_y, use_y = BASE - scale.px(cap), BASE - scale.px(usable)
    use_label_y = max(use_y, cap_y + 14)  # the labels one line apart when the reserve is thin
    u, reserve = scale.unit, f"({100 * panel.reserve_fraction:.0f}% reserve)"
    return [
        *_line("capacity", cap, f"device {scale.figure(cap)} {u}", plot_width, CAPACITY_COLOUR, "", cap_y, cap_y),
        *_line(
            "usable", usable, f"usable {scale.figure(usable)} {u}", plot_width, USABLE_COLOUR,
            ' stroke-dasharray="6 4"', use_y, use_label_y,
        ),
        _text(LEFT + plot_width + 6, use_label_y + 17, reserve, size=10, anchor="start", fill=USABLE_COLOUR),
    ]  # fmt: skip


def _over(s, usable) -> bool:
    """The stage's predicted or measured peak is above the usable line."""
    return usable is not None and max(s.predicted_peak_bytes, s.measured_peak_bytes or 0) > usable


def render_panel_svg(panel, scale: Scale, width: int) -> str:
    """The panel's chart, ``width`` px wide, on the page's shared ``scale``."""
    plot_width = width - LEFT - RIGHT
    height = BASE + BOTTOM
    group, bar, measured = _bar_widths(panel, plot_width)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" {FONT} role="img" aria-label="{escape(panel.title)}">',
        *_axis(scale, plot_width),
    ]
    labels: list[str] = []  # the figures above the bars, drawn last: over the device lines
    for i, s in enumerate(panel.stages):
        over = _over(s, panel.usable_bytes)
        left = LEFT + i * group + (group - bar - measured - (2 if measured else 0)) / 2
        if s.parts:  # a run that logged no prediction shows its measurement alone
            out += _predicted_bar(s, left, bar, scale, over, labels)
        if s.measured_peak_bytes is not None:
            out += _measured_bar(s, left + bar + 2, measured, scale, labels)
        centre = LEFT + (i + 0.5) * group
        if bar < LABEL_WIDTH - 2 and group >= LABEL_WIDTH and s.parts:
            # Bars too narrow for their own figures: the predicted peak above the pair.
            top = BASE - scale.px(max(s.predicted_peak_bytes, s.measured_peak_bytes or 0))
            figure = scale.figure(s.predicted_peak_bytes)
            colour = OVER_COLOUR if over else "#000"
            labels.append(_text(centre, top - 4, figure, size=9, fill=colour, bold=True, halo=True))
        if measured and bar >= 30:  # under each bar what it is: a prediction or a measurement
            out.append(_text(left + bar / 2, BASE + 13, "pred.", size=9, fill="#555"))
            out.append(_text(left + bar + 2 + measured / 2, BASE + 13, s.measured_label, size=9, fill="#555"))
        label = f"stage {s.stage}" if group >= 56 else str(s.stage)
        out.append(_text(centre, BASE + 30, label, fill=OVER_COLOUR if over else "#000", bold=over))
    out.append(f'<line x1="{LEFT}" y1="{BASE}" x2="{LEFT + plot_width}" y2="{BASE}" stroke="#000"/>')
    out += _capacity_lines(panel, scale, plot_width)
    out += labels
    out.append("</svg>")
    return "\n".join(out)
