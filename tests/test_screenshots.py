"""The README's screenshot of ``top`` cannot drift: docs/img/top.txt is what the current ``top`` renders from
the documents captured from a running demo (docs/img/top-input.json), and the PNG is drawn from the same
frame. A change to what ``top`` shows fails here until ``make screenshots`` (a new capture) or
``python tests/screenshots.py render`` (the same capture, the new code) is run."""

from __future__ import annotations

import json
from pathlib import Path

import screenshots
from PIL import Image


def _doc() -> dict:
    return json.loads(screenshots.INPUT.read_text(encoding="utf-8"))


def test_committed_top_txt_is_what_top_renders_from_the_captured_demo() -> None:
    committed = (screenshots.IMG / "top.txt").read_text(encoding="utf-8")
    assert committed == screenshots.text(_doc()), (
        "docs/img/top.txt differs from what top renders now: run `make screenshots` (or "
        "`python tests/screenshots.py render`) and commit docs/img/")


def test_the_capture_is_a_demo_with_runs_finished_and_under_way() -> None:
    doc = _doc()
    assert doc["status"]["simulated"] is True  # the screenshot says SIMULATED, and is
    statuses = [r["status"] for r in doc["runs"]]
    assert statuses.count("finished") >= 2 and "running" in statuses
    text = screenshots.text(doc)
    assert "SIMULATED DATA" in text and "TRAINING RUNS (1 active, 2 recent)" in text
    assert "http://localhost:9863" in text.splitlines()[0]  # the URL a user types, not the capture's port


def test_the_png_is_drawn_from_the_same_frame(tmp_path: Path) -> None:
    # Not pixel for pixel (font rasterising may change with Pillow's FreeType): the same grid of rows and
    # columns, the title row in the terminal's title colour and the SIMULATED banner in its yellow.
    out = tmp_path / "top.png"
    screenshots.png(_doc(), out)
    committed = Image.open(screenshots.IMG / "top.png").convert("RGB")
    drawn = Image.open(out).convert("RGB")
    assert drawn.size == committed.size
    for img in (drawn, committed):
        assert img.getpixel((img.width - 12, 12)) == (0x1F, 0x4E, 0x9E)  # title row, right edge
        colours = {c for _, c in img.getcolors(1 << 20) or []}
        assert (0xE0, 0xC0, 0x00) in colours  # the SIMULATED banner
