"""README's "Try it without a GPU", in its order, on a fresh install (tests/freshinstall.py: the wheel with
the ``[report]`` extra, what ``make run`` installs, in a new virtual environment): the demo, ``runs``,
``report`` and ``top`` each succeed, and the numbers they show agree with each other (issue 12)."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from freshinstall import Demo, FreshInstall

pytestmark = pytest.mark.slow


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def test_demo_then_runs_report_and_top(fresh_install: FreshInstall, tmp_path: Path) -> None:
    demo = Demo(fresh_install, ["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                                "--demo.pause=3s", "--demo.run-duration=15s", "--demo.runs=1",
                                "--demo.export-interval=500ms", "--collector.interval=250ms", "--runs.warmup=2s"])
    try:
        url = demo.url()
        deadline = time.monotonic() + 60
        finished: list[dict[str, Any]] = []
        while not finished and time.monotonic() < deadline:
            finished = [r for r in _get(url + "/api/v1/runs")["runs"] if r.get("status") == "finished"]
            time.sleep(0.5)
        assert finished, "the demo's run did not finish:\n" + demo.log()
        run_id = finished[0]["run_id"]

        # runs: the README's form, and the default ($GPU_ENERGY_EXPORTER_URL) without --url
        out = fresh_install.run("runs", "--url", url)
        assert out.returncode == 0, out.stderr
        # The first column is what a user copies into `report` (issue 22: it read "<id> (SIMULATED)", which
        # report refused); the mark sits on the status.
        line = next(li for li in out.stdout.splitlines() if li.startswith(run_id))
        copied = line.split()[0]
        assert copied == run_id and line.rstrip().endswith("finished (SIMULATED)")
        out = fresh_install.run("runs", "--format", "json", GPU_ENERGY_EXPORTER_URL=url)
        assert out.returncode == 0, out.stderr
        row = next(r for r in json.loads(out.stdout)["runs"] if r["run_id"] == run_id)

        # report, with plots (matplotlib from the [report] extra that make run installs)
        out = fresh_install.run("report", copied, "--url", url, "--out", str(tmp_path / "report"), timeout=180)
        assert out.returncode == 0, out.stderr
        summary = json.loads((tmp_path / "report" / "report.json").read_text())["runs"][0]["summary"]
        pngs = list((tmp_path / "report").rglob("*.png"))
        assert len(pngs) >= 5

        # top, one frame
        out = fresh_install.run("top", "--once", "--url", url)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SIMULATED" in out.stdout and "RAM used" in out.stdout
    finally:
        rc = demo.stop()
    text = demo.log()
    assert rc == 0, text
    assert "level=error" not in text and "Traceback" not in text

    # The numbers agree: average power at most the peak, energy = average power x duration (1%).
    for figures in (summary, row):
        energy, avg, peak, duration = (figures[k] for k in ("energy_j", "avg_power_w", "peak_power_w", "duration_s"))
        assert energy > 0 and duration > 10
        assert avg <= peak, figures
        assert energy == pytest.approx(avg * duration, rel=0.01)
    assert summary["energy_j"] == pytest.approx(row["energy_j"], rel=1e-9)
