"""The README's screenshot of ``top`` (docs/img/top.txt and docs/img/top.png), made from a running demo so
that it cannot drift from what ``top`` shows.

    python tests/screenshots.py capture   # (make screenshots) run the demo until one run is under way and two
                                          # have finished, save what top reads (/api/v1/status, /api/v1/runs)
                                          # as docs/img/top-input.json, then render; and draw
                                          # docs/img/report-comparison.png with `report` on the two finished runs
    python tests/screenshots.py render    # top.txt and top.png from docs/img/top-input.json, current code

The frame is ``top``'s own renderer (``client.top.render_frame``, what the terminal and ``top --once`` draw)
applied to the captured documents, at 120 columns, with the capture's clock, in UTC, and the default URL the
user types. tests/test_screenshots.py checks that the committed top.txt is what the current code renders from
the committed input, so a change to ``top`` fails the suite until ``make screenshots`` (or ``render``) is run.
This module writes only under docs/img/ and talks only to the demo it starts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMG = ROOT / "docs" / "img"
INPUT = IMG / "top-input.json"
WIDTH = 120
#: What the user types (the commands' default), not the capture's private port.
URL = "http://localhost:9863"
#: Runs of 40 s with 5 s pauses, not the demo's default 3 min and 20 s: two runs finish and a third is
#: under way in about two minutes (README and docs/workstation.md say so under the pictures).
DEMO_FLAGS = ["--demo.pause=5s", "--demo.run-duration=40s", "--demo.export-interval=1s"]


def frame(doc: dict[str, Any]) -> list[list[tuple[str, str]]]:
    """top's styled lines for a captured input, rendered in UTC whatever the machine's zone."""
    from gpu_energy_exporter.client.top import View, render_frame

    zone = os.environ.get("TZ")
    os.environ["TZ"] = "UTC"
    time.tzset()
    try:
        view = View(status=doc["status"], runs=doc["runs"], fetched_at=0.0)
        return render_frame(view, url=URL, interval=1.0, width=WIDTH, now=doc["now"], clock=lambda: 0.0)
    finally:
        if zone is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = zone
        time.tzset()


def text(doc: dict[str, Any]) -> str:
    from gpu_energy_exporter.client.top import frame_text

    return frame_text(frame(doc))


#: The terminal's look (client/top/screen.py's curses styles): (foreground, background, bold).
_STYLES = {"title": ("#ffffff", "#1f4e9e", True), "sim": ("#000000", "#e0c000", True), "ok": ("#4ec94e", None, False),
           "warn": ("#e0c000", None, False), "bad": ("#ff5555", None, True), "head": ("#4fc8d8", None, True),
           "dim": ("#8a8a8a", None, False), "bold": ("#ffffff", None, True), "": ("#d0d0d0", None, False)}



def _fonts() -> Path:
    """matplotlib's own copy of DejaVu Sans Mono (the [report] extra): the same font on every machine."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def png(doc: dict[str, Any], path: Path) -> None:
    """The frame drawn as a terminal would (DejaVu Sans Mono, the curses colours), trailing blank rows cut."""
    from PIL import Image, ImageDraw, ImageFont

    lines = frame(doc)
    while lines and not "".join(t for t, _ in lines[-1]).strip():
        lines.pop()
    size = 15
    regular = ImageFont.truetype(str(_fonts() / "DejaVuSansMono.ttf"), size)
    bold = ImageFont.truetype(str(_fonts() / "DejaVuSansMono-Bold.ttf"), size)
    cell_w, cell_h = regular.getlength("M"), int(size * 1.35)
    img = Image.new("RGB", (int(cell_w * WIDTH) + 16, cell_h * len(lines) + 16), "#101010")
    draw = ImageDraw.Draw(img)
    for row, line in enumerate(lines):
        x, y = 0, 8 + row * cell_h
        for segment, style in line:
            fg, bg, is_bold = _STYLES.get(style, _STYLES[""])
            if style == "title":  # curses paints the title's colour across the whole row
                draw.rectangle([8, y, 8 + cell_w * WIDTH, y + cell_h - 1], fill=bg)
            elif bg:
                draw.rectangle([8 + cell_w * x, y, 8 + cell_w * (x + len(segment)), y + cell_h - 1], fill=bg)
            draw.text((8 + cell_w * x, y + 2), segment, fill=fg, font=bold if is_bold else regular)
            x += len(segment)
    img.save(path, optimize=True)


def render() -> None:
    doc = json.loads(INPUT.read_text(encoding="utf-8"))
    (IMG / "top.txt").write_text(text(doc), encoding="utf-8")
    png(doc, IMG / "top.png")
    print(f"wrote {IMG / 'top.txt'} and {IMG / 'top.png'} from {INPUT}")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def comparison(url: str, run_ids: list[str]) -> None:
    """docs/img/report-comparison.png: `report`'s comparison of the demo's first two finished runs."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "gpu_energy_exporter", "report", *run_ids, "--url", url, "--out", out],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        shutil.copyfile(Path(out) / "comparison.png", IMG / "report-comparison.png")
    print(f"wrote {IMG / 'report-comparison.png'} ({' against '.join(run_ids)})", flush=True)


def capture(timeout: float = 600.0) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "gpu_energy_exporter", "demo", f"--web.listen-address=127.0.0.1:{port}",
           "--otlp.listen-address=127.0.0.1:0", *DEMO_FLAGS]
    print("starting:", " ".join(cmd[1:]), flush=True)
    demo = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(2)
            try:
                status, runs = _get(url + "/api/v1/status"), _get(url + "/api/v1/runs")["runs"]
            except OSError:
                continue
            done = [r for r in runs if r.get("status") == "finished"]
            active = [r for r in runs if r.get("status") == "running"]
            steps = [(r.get("steps") or 0) / (r.get("total_steps") or 1) for r in active]
            print(f"  {len(done)} finished, {len(active)} running {[f'{s:.0%}' for s in steps]}", flush=True)
            if len(done) >= 2 and active and steps[0] >= 0.6:
                doc = {"captured_from": "gpu-energy-exporter demo " + " ".join(DEMO_FLAGS), "now": time.time(),
                       "status": status, "runs": runs}
                INPUT.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n", encoding="utf-8")
                comparison(url, [r["run_id"] for r in done[:2]])
                break
        else:
            raise SystemExit(f"the demo had not reached two finished runs and a third under way in {timeout:.0f}s")
    finally:
        demo.send_signal(signal.SIGINT)
        demo.wait(60)
    render()


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    {"capture": capture, "render": render}[sys.argv[1] if len(sys.argv) > 1 else "render"]()
