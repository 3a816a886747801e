#!/usr/bin/env python
"""Render an HTML page to PNG in a real browser: Debian's chromium, headless.

    python tools/render_html.py PAGE.html OUT.png [--width 1280] [--height PX] [--timeout 60]

The memory pages (tools/memory_report.py --html, the preflight's and the planner's) are checked this
way: what a reader sees, fonts, layout and SVG included. Chromium runs with a fresh profile in a new
temporary directory, no network features and no sandbox (it runs as root in containers), and its
whole process group is killed after --timeout seconds. Without --height the page's own height is
measured first (a copy of the page, in the temporary directory, with one line of script that records
its scroll height, read back through --dump-dom; the page itself stays script-free), so the PNG holds
the whole page and no more. With Pillow (matplotlib brings it) the PNG is then palette-quantised (a
page's few flat colours: a third of the bytes). Chromium missing: `make browser` installs it.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
PROG = "render_html.py"
FLAGS = (
    "--headless",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",  # a scrollbar would narrow the layout: measure and shoot at the full width
    "--proxy-server=127.0.0.1:9",  # nothing a page names is fetched: offline by construction
    # Chromium's sandbox cannot start as root; as any other user it stays on.
    *(("--no-sandbox",) if hasattr(os, "geteuid") and os.geteuid() == 0 else ()),
)
# Chromium renders a copy of the page whose policy runs none of its scripts and fetches nothing: only
# the measuring line, by its nonce, and the page's inline styles and data: images.
POLICY = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; font-src data:; script-src {scripts}"
HEAD = re.compile(r"<head\b[^>]*>", re.IGNORECASE)
DOCTYPE = re.compile(r"^\s*<!doctype[^>]*>", re.IGNORECASE)
FALLBACK_HEIGHT = 2400  # px, when the page's height cannot be measured
# Appended to the measuring copy: the document's height as an attribute --dump-dom prints.
MEASURE = '<script nonce="render">document.body.setAttribute("data-render-height", document.documentElement.scrollHeight)</script>'


def chromium_command(page: str, out: str, width: int, height: int, profile: str) -> list[str]:
    """The chromium command line that screenshots ``page`` into ``out``."""
    return [
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={profile}",
        f"--screenshot={out}",
        f"--window-size={width},{height}",
        Path(page).resolve().as_uri(),
    ]


def _run(command: list[str], timeout: float) -> tuple[int, str]:
    """(exit status, stdout) of ``command`` in its own process group, killed whole on timeout
    (subprocess.TimeoutExpired): chromium's zygote and renderers go with it."""
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    if process.returncode != 0:
        lines = (stderr or stdout).strip().splitlines()
        raise RuntimeError(f"chromium exited {process.returncode}: {lines[-1] if lines else 'no output'}")
    return process.returncode, stdout


def policed_copy(page: str, copy: str, scripts: str = "'none'", tail: str = "") -> str:
    """Write ``page`` to ``copy`` with the policy in its head (``scripts``: what may run) and ``tail``
    before ``</body>``; returns ``copy``."""
    text = Path(page).read_text(encoding="utf-8", errors="replace")
    meta = f'<meta http-equiv="Content-Security-Policy" content="{POLICY.format(scripts=scripts)}">'
    if head := HEAD.search(text):
        text = text[: head.end()] + meta + text[head.end() :]
    else:
        at = doctype.end() if (doctype := DOCTYPE.match(text)) else 0
        text = text[:at] + f"<head>{meta}</head>" + text[at:]
    at = text.rfind("</body>")
    text = text[:at] + tail + text[at:] if at >= 0 else text + tail
    Path(copy).write_text(text, encoding="utf-8")
    return copy


def measure_height(page: str, width: int, timeout: float, workdir: str) -> int | None:
    """The page's height in px when laid out ``width`` px wide, or None when it cannot be read."""
    copy = policed_copy(page, os.path.join(workdir, "measure.html"), "'nonce-render'", MEASURE)
    profile = os.path.join(workdir, "measure-profile")
    command = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", f"--window-size={width},600", "--dump-dom"]
    _, dom = _run([*command, Path(copy).as_uri()], timeout)
    found = re.search(r'data-render-height="(\d+)"', dom)
    return int(found.group(1)) if found else None


def quantize(path: str) -> None:
    """The PNG as a 256-colour palette image, when Pillow is there (else left as chromium wrote it)."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        rgb = image.convert("RGB")
    rgb.quantize(colors=256, method=Image.Quantize.MEDIANCUT).save(path, optimize=True)


def render(page: str, out: str, width: int, height: int | None, timeout: float) -> int:
    """Screenshot ``page`` into ``out`` (``height`` None: the page's own); the height used.
    RuntimeError with chromium's last line when it fails, subprocess.TimeoutExpired when it hangs."""
    workdir = tempfile.mkdtemp(prefix="render_html_")
    try:
        if height is None:
            height = measure_height(page, width, timeout, workdir) or FALLBACK_HEIGHT
        profile = os.path.join(workdir, "profile")
        shot = os.path.join(workdir, "shot.png")
        shown = policed_copy(page, os.path.join(workdir, "page.html"))
        _run(chromium_command(shown, shot, width, height, profile), timeout)
        if not os.path.isfile(shot):
            raise RuntimeError(f"chromium wrote no {out}")
        quantize(shot)
        # Into place in one step: a failed render leaves the previous PNG intact.
        tmp = f"{out}.tmp{os.getpid()}"
        shutil.copyfile(shot, tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return height


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Render an HTML page to PNG in headless chromium."
    )
    parser.add_argument("page", help="the HTML file")
    parser.add_argument("out", help="the PNG to write")
    parser.add_argument("--width", type=int, default=1280, help="window width in px (default 1280)")
    parser.add_argument("--height", type=int, help="window height in px (default: the page's own height)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before chromium is killed")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.page):
        print(f"{PROG}: error: {args.page} is not a file", file=sys.stderr)
        return 2
    if not os.access(CHROMIUM, os.X_OK):
        print(
            f"{PROG}: error: {CHROMIUM} not found: run `make browser` (installs Debian's chromium)",
            file=sys.stderr,
        )
        return 2
    out = os.path.abspath(args.out)
    try:
        height = render(args.page, out, args.width, args.height, args.timeout)
    except subprocess.TimeoutExpired:
        print(f"{PROG}: error: chromium did not finish in {args.timeout:g} s", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"rendered {args.page} to {args.out} ({args.width} x {height} px)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
