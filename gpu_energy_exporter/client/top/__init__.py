"""``gpu-energy-exporter top``: a live terminal view of a running exporter, local or remote.

Shows, refreshed every ``--interval``: per GPU power, energy, utilisation, temperature and VRAM bars; the
active training runs with J/token, tokens/s, loss, elapsed time, ETA and CO2 so far; host RAM with a
warning below the exporter's critical threshold. Works over SSH (curses from the standard library, no
mouse, no true colour), follows terminal resizes and exits on ``q`` or Ctrl-C with the terminal restored.
When stdout is not a terminal (a pipe, a log file) or with ``--once`` it prints plain-text frames.

Everything it shows comes from the exporter's JSON API (``/api/v1/status`` and ``/api/v1/runs``, see
``daemon/api.py``); the HTTP client (``client/api.py``, basic auth and TLS options) is the one ``runs``
and ``report`` use. The command only reads: it never calls NVML, never writes to the exporter, and never
lets a slow or unreachable exporter freeze the keyboard (fetching runs on its own thread).

The package, by job: ``frame`` (pure: documents to styled lines), ``poller`` (the fetching thread),
``screen`` (curses view and plain-text frames), ``cli`` (flags, signals, ``main``). This ``__init__`` only
names the public API.
"""

from __future__ import annotations

from gpu_energy_exporter.client.top.cli import main, new_parser
from gpu_energy_exporter.client.top.frame import (
    View,
    bar,
    eta_seconds,
    fmt_age,
    fmt_energy,
    frame_text,
    render_frame,
)
from gpu_energy_exporter.client.top.poller import Poller

__all__ = [
    "Poller", "View", "bar", "eta_seconds", "fmt_age", "fmt_energy", "frame_text", "main", "new_parser", "render_frame",
]
