"""The command line of ``gpu-energy-exporter top``: flags, the choice between the curses view and text
frames, and signals (SIGTERM and SIGHUP end the view like Ctrl-C, with the terminal restored).

This module only wires the client, the poller and an output together; it never fetches and never draws
itself.
"""

from __future__ import annotations

import argparse
import locale
import os
import signal
import sys
import threading
from typing import IO, Any

from gpu_energy_exporter.client.api import ExporterUnreachable, add_client_flags, client_from_args
from gpu_energy_exporter.client.safeout import printable_stream
from gpu_energy_exporter.client.top.poller import Poller
from gpu_energy_exporter.client.top.screen import run_curses, run_plain
from gpu_energy_exporter.core.flagparser import FlagParser
from gpu_energy_exporter.core.flagtypes import parse_duration


def _unicode_ok(stream: IO[str]) -> bool:
    encoding = (getattr(stream, "encoding", None) or locale.getpreferredencoding(False) or "").lower()
    return encoding.replace("-", "").startswith("utf8")


def new_parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="gpu-energy-exporter top",
        description="Live terminal view of a running exporter: GPU power, energy, utilisation, temperature "
                    "and VRAM; active training runs (J/token, tokens/s, loss, ETA, CO2); host RAM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""keys: q, Esc or Ctrl-C quit. Without a terminal (a pipe) or with --once it prints text frames.
examples:
  gpu-energy-exporter top                                   the exporter on this machine
  gpu-energy-exporter top --url http://gpu-node-7:9863 --interval 2s
  gpu-energy-exporter top --url https://node:9863 --user ops --password-file ~/.exporter-pw --ca-file ca.pem
  gpu-energy-exporter top --once | head -20                 one text frame, for scripts and bug reports
""")
    add_client_flags(parser)
    parser.add_argument("--interval", default="1s", metavar="DURATION",
                        help="refresh interval, e.g. 500ms, 1s, 5s (default: 1s)")
    parser.add_argument("--once", action="store_true", help="print one text frame and exit (1 if unreachable)")
    parser.add_argument("--ascii", action="store_true", help="draw bars with ASCII characters only")
    return parser


def main(argv: list[str], *, stdout: IO[str] | None = None, stderr: IO[str] | None = None) -> int:
    # frames and errors carry what clients and the exporter sent: no control character reaches the terminal
    out = printable_stream(stdout if stdout is not None else sys.stdout)
    err = printable_stream(stderr if stderr is not None else sys.stderr)
    parser = new_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        interval = parse_duration(args.interval)
    except ValueError as exc:
        print(f"gpu-energy-exporter top: error: --interval {args.interval!r} {exc}", file=err)
        return 2
    if interval < 0.1:
        print("gpu-energy-exporter top: error: --interval must be at least 100ms", file=err)
        return 2
    try:
        client = client_from_args(args, timeout=max(2.0, min(10.0, interval * 3)))
    except ExporterUnreachable as exc:
        print(f"gpu-energy-exporter top: error: {exc}", file=err)
        return 2
    poller = Poller(client, interval)
    url = client.base_url
    interactive = not args.once and stdout is None and sys.stdout.isatty() and sys.stdin.isatty() \
        and os.environ.get("TERM", "") not in ("", "dumb")
    if interactive:
        try:
            locale.setlocale(locale.LC_ALL, "")  # curses needs it to draw UTF-8 bars
        except locale.Error:
            pass  # an unknown LANG: the C locale, and ASCII bars below
    unicode = not args.ascii and _unicode_ok(out)
    stop = threading.Event()
    previous = _on_signals(stop, interactive)
    try:
        if interactive:
            poller.start()
            return run_curses(poller, url=url, unicode=unicode)
        return run_plain(poller, once=args.once, out=out, url=url, unicode=unicode, stop=stop)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # `top --once | head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the interpreter's flush at exit
        except OSError:
            pass
        return 0
    finally:
        poller.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_signals(stop: threading.Event, interactive: bool) -> dict[int, Any]:
    """SIGTERM and SIGHUP (an SSH session that drops) end the view like Ctrl-C, so curses restores the
    terminal; in text mode they end the loop between frames."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous

    def handler(_signum: int, _frame: object) -> None:
        stop.set()
        if interactive:
            raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, handler)
    return previous
