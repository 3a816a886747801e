"""A memory page (megatron_lite/training/memory/picture) read back without a browser: its panels, each
stage's drawn parts and measured bar, its lines, and every attribute naming another resource."""

from __future__ import annotations

from dataclasses import dataclass, field
from html.parser import HTMLParser


@dataclass
class Panel:
    """One panel's SVG as drawn: per stage the part rects bottom to top as (part, bytes, y, height),
    the predicted group's <title>, the measured bar as (bytes, x, y, height, label); lines by class as
    (bytes, y)."""

    parts: dict[int, list[tuple[str, int, float, float]]] = field(default_factory=dict)
    part_x: dict[int, float] = field(default_factory=dict)
    titles: dict[int, str] = field(default_factory=dict)
    measured: dict[int, tuple[int, float, float, float, str]] = field(default_factory=dict)
    lines: dict[str, tuple[int, float]] = field(default_factory=dict)
    texts: list[str] = field(default_factory=list)


class PageReader(HTMLParser):
    """Collects the panels, the references (src / href / CSS url) and the tags of a page."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.panels: list[Panel] = []
        self.references: list[str] = []
        self.tags: list[str] = []
        self._group: dict | None = None  # the open bar group's attributes
        self._title: list[str] | None = None
        self._text: list[str] | None = None
        self.style = ""
        self._in_style = False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags.append(tag)
        self.references += [v for k, v in attrs if k in ("src", "href", "xlink:href") and v]
        if tag == "style":
            self._in_style = True
        elif tag == "svg" and a.get("role") == "img":
            self.panels.append(Panel())
        elif tag == "g" and a.get("class") in ("predicted", "measured"):
            self._group = a
        elif tag == "rect" and self._group is not None:
            stage = int(self._group["data-stage"])
            panel = self.panels[-1]
            y, h, x = float(a["y"]), float(a["height"]), float(a["x"])
            if self._group["class"] == "predicted":
                panel.parts.setdefault(stage, []).append((a["data-part"], int(a["data-bytes"]), y, h))
                panel.part_x[stage] = x
            else:
                label = self._group["data-label"]
                panel.measured[stage] = (int(self._group["data-bytes"]), x, y, h, label)
        elif tag == "line" and a.get("class") in ("capacity", "usable"):
            self.panels[-1].lines[a["class"]] = (int(a["data-bytes"]), float(a["y1"]))
        elif tag == "title" and self._group is not None and self._group["class"] == "predicted":
            self._title = []
        elif tag == "text":
            self._text = []

    def handle_endtag(self, tag):
        if tag == "style":
            self._in_style = False
        elif tag == "g":
            self._group = None
        elif tag == "title" and self._title is not None:
            self.panels[-1].titles[int(self._group["data-stage"])] = "".join(self._title)
            self._title = None
        elif tag == "text" and self._text is not None:
            self.panels[-1].texts.append("".join(self._text))
            self._text = None

    def handle_data(self, data):
        if self._in_style:
            self.style += data
        if self._title is not None:
            self._title.append(data)
        if self._text is not None:
            self._text.append(data)


def read_page(html: str) -> PageReader:
    """The page's panels, references and tags."""
    reader = PageReader()
    reader.feed(html)
    reader.close()
    return reader
