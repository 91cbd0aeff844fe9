"""Fetching for ``gpu-energy-exporter top``: ``/api/v1/status`` and ``/api/v1/runs`` every ``--interval``
on a daemon thread, through the one exporter client (``client/api.py``).

This module holds the thread and the lock; it never draws and never lets a slow or unreachable exporter
block its caller (``view()`` returns a copy of the latest fetch at once).
"""

from __future__ import annotations

import threading
import time

from gpu_energy_exporter.client.api import RUNS_PATH, STATUS_PATH, ExporterClient, ExporterUnreachable
from gpu_energy_exporter.client.top.frame import View


class Poller:
    """Fetches status and runs every ``interval`` on a daemon thread; ``view()`` returns the latest."""

    def __init__(self, client: ExporterClient, interval: float) -> None:
        self.client = client
        self.interval = interval
        self._lock = threading.Lock()
        self._view = View()
        self.changed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="top-poller", daemon=True)

    def start(self) -> Poller:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def view(self) -> View:
        with self._lock:
            v = self._view
            return View(v.status, list(v.runs), v.fetched_at, v.error, v.failures)

    def fetch_once(self) -> None:
        try:
            status = self.client.get(STATUS_PATH)
            runs_doc = self.client.get(RUNS_PATH)
            runs = runs_doc.get("runs") if isinstance(runs_doc, dict) else None
            if not isinstance(status, dict) or not isinstance(runs, list):
                raise ExporterUnreachable(f"{self.client.base_url} answered an unexpected JSON document")
        except ExporterUnreachable as exc:
            with self._lock:
                self._view.error = str(exc)
                self._view.failures += 1
        else:
            with self._lock:
                self._view = View(status, [r for r in runs if isinstance(r, dict)], time.monotonic(), None, 0)
        self.changed.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.fetch_once()
            self._stop.wait(max(0.05, self.interval - (time.monotonic() - started)))
