"""The two outputs of ``gpu-energy-exporter top``: the interactive curses view (colours, resizes, ``q`` to
quit) and plain-text frames for a pipe, a log file or ``--once``.

Both draw what ``frame.render_frame`` returns; this module only maps styles to curses attributes and
writes to the terminal or the stream. It never fetches itself (``poller.py`` does) and imports curses
only when the interactive view starts, so ``--once`` works where curses is missing.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from typing import IO, Any

from gpu_energy_exporter.client.top.frame import STYLES, View, frame_text, render_frame
from gpu_energy_exporter.client.top.poller import Poller
from gpu_energy_exporter.core.textfmt import printable


def run_plain(poller: Poller, *, once: bool, out: IO[str], url: str, unicode: bool, width: int | None = None,
              stop: threading.Event | None = None) -> int:
    """One text frame per interval (or one with ``once``); returns 1 when ``once`` could not reach it."""
    stop = stop or threading.Event()
    while True:
        started = time.monotonic()
        poller.fetch_once()
        view = poller.view()
        cols = width or shutil.get_terminal_size((120, 40)).columns
        out.write(frame_text(render_frame(view, url=url, interval=poller.interval, width=cols, unicode=unicode,
                                          once=once)))
        out.flush()
        if once:
            return 0 if view.status is not None else 1
        out.write("\n")
        if stop.wait(max(0.05, poller.interval - (time.monotonic() - started))):
            return 0


def run_curses(poller: Poller, *, url: str, unicode: bool) -> int:
    import curses  # noqa: PLC0415 - only the interactive view needs it

    def app(stdscr: Any) -> int:
        try:
            curses.curs_set(0)
        except curses.error:
            pass  # some terminals cannot hide the cursor
        styles: dict[str, int] = dict.fromkeys(STYLES, curses.A_NORMAL)
        if curses.has_colors():
            curses.start_color()
            try:
                curses.use_default_colors()
                bg = -1
            except curses.error:
                bg = curses.COLOR_BLACK
            pairs = {"ok": curses.COLOR_GREEN, "warn": curses.COLOR_YELLOW, "bad": curses.COLOR_RED,
                     "head": curses.COLOR_CYAN}
            for n, (name, fg) in enumerate(pairs.items(), start=1):
                curses.init_pair(n, fg, bg)
                styles[name] = curses.color_pair(n)
            curses.init_pair(10, curses.COLOR_WHITE, curses.COLOR_BLUE)
            curses.init_pair(11, curses.COLOR_BLACK, curses.COLOR_YELLOW)
            styles["title"] = curses.color_pair(10) | curses.A_BOLD
            styles["sim"] = curses.color_pair(11) | curses.A_BOLD
            styles["head"] |= curses.A_BOLD
            styles["bad"] |= curses.A_BOLD
        else:
            styles.update(title=curses.A_REVERSE, sim=curses.A_REVERSE, bad=curses.A_BOLD, head=curses.A_BOLD)
        styles["dim"] = curses.A_DIM
        styles["bold"] = curses.A_BOLD
        stdscr.timeout(100)  # ms: keys stay responsive while the poller waits on the network
        try:
            curses.set_escdelay(50)  # Esc quits without ncurses' default one-second wait for a sequence
        except (AttributeError, curses.error):
            pass
        redraw = True
        while True:
            key = stdscr.getch()
            if key in (ord("q"), ord("Q"), 27):
                return 0
            if key == curses.KEY_RESIZE:
                curses.update_lines_cols()
                redraw = True
            if poller.changed.is_set():
                poller.changed.clear()
                redraw = True
            if redraw:
                _draw(stdscr, poller.view(), styles, url, poller.interval, unicode)
                redraw = False

    # ncurses prefers LINES/COLUMNS from the environment to the terminal's real size: some tools export
    # them, they go stale when the terminal is resized, and the view would then never follow KEY_RESIZE.
    for name in ("LINES", "COLUMNS"):
        os.environ.pop(name, None)
    return int(curses.wrapper(app))


def _draw(stdscr: Any, view: View, styles: dict[str, int], url: str, interval: float, unicode: bool) -> None:
    import curses  # noqa: PLC0415

    height, width = stdscr.getmaxyx()
    stdscr.erase()
    lines = render_frame(view, url=url, interval=interval, width=width, unicode=unicode)
    for y, line in enumerate(lines[:height]):
        x = 0
        for raw, style in line:
            text = printable(raw, keep_newlines=False)  # values pushed over OTLP: no escape sequences
            room = width - x - (1 if y == height - 1 else 0)  # the bottom-right cell cannot be written
            if room <= 0:
                break
            try:
                stdscr.addnstr(y, x, text, room, styles.get(style, curses.A_NORMAL))
            except curses.error:
                pass  # a cell beyond a resized window: drawn again on the next frame
            x += min(len(text), room)
        if y == 0:
            try:
                stdscr.chgat(0, x, max(0, width - x - 1), styles["title"])
            except curses.error:
                pass
    if len(lines) > height:
        try:
            stdscr.addnstr(height - 1, 0, f"… {len(lines) - height + 1} more lines: enlarge the terminal",
                           width - 1, curses.A_DIM)
        except curses.error:
            pass
    stdscr.refresh()
