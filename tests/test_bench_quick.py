"""The benchmarks' smoke run: ``python -m bench --quick`` prints every table, with numbers in them.

Timings are never asserted (they belong to docs/benchmarks.md, measured by hand): only that each benchmark
ran, printed its command and machine, and filled its tables with figures. The quick run takes about 40 s on
a 2-core machine (it starts several exporters and load generators); the rest of the file checks the pure
arithmetic the accuracy tables rest on.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, Child

if str(ROOT) not in sys.path:  # `pytest` run without `python -m` does not put the repository root there
    sys.path.insert(0, str(ROOT))

from bench import accuracy, harness  # noqa: E402

NUMBER = re.compile(r"^[-+<>~]?\s?\d[\d,]*(\.\d+)?\s?(%|ms|µs|x)?( \([-+]?\d[\d,.]*%\))?$")

#: Table titles (prefixes) the quick run must print, each with at least one row of figures.
EXPECTED_TABLES = (
    "/metrics latency in ms by GPUs and training series",
    "Formats at 8 GPUs + 1,000 series",
    "8 GPUs + 1,000 series under push load",
    "8 GPUs + 1,000 series while NVML is slow",
    "Full re-push: every one of the",
    "Exporter process at --collector.interval=1s on fake H100s",
    "NVML cost by function, 8 fake H100s",
    "Exporter process under load, 8 fake H100s",
    "Error against the exact integral over every 60 s window",
    "Memory over a",
    "In process, one thread",
    "Over HTTP",
    "Memory under churn",
    "A runaway trainer",
    "ns per step(",
    "Traces (one fake H100 each",
    "Energy error over 5 s windows",
    "Energy error over 1 s windows",
    "Energy error over the whole",
    "Run energy against the exact integral over [start, end]",
)


def parse_tables(text: str) -> dict[str, list[list[str]]]:
    """``{title: rows}`` of every Markdown table under a ``### title`` heading (header and rule dropped)."""
    tables: dict[str, list[list[str]]] = {}
    title = None
    rows: list[list[str]] = []
    for line in text.splitlines():
        if line.startswith("### "):
            title, rows = line[4:].strip(), []
            tables[title] = rows
        elif title is not None and line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return {t: r[2:] for t, r in tables.items()}  # drop the header row and the |---| rule


@pytest.fixture(scope="module")
def quick_output() -> str:
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick"], cwd=ROOT, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_run_prints_command_machine_and_every_benchmark(quick_output: str) -> None:
    assert "FAILED" not in quick_output
    assert "command: `python -m bench --quick`" in quick_output
    machine_lines = [line for line in quick_output.splitlines() if line.startswith("machine: ")]
    # once for the whole run, then once per benchmark section
    assert len(machine_lines) == 1 + len(harness_modules())
    assert all("cores" in line and "Python" in line for line in machine_lines)
    for name in harness_modules():
        module = __import__(f"bench.{name}", fromlist=["TITLE"])
        assert f"## {module.TITLE}" in quick_output


def harness_modules() -> tuple[str, ...]:
    from bench.__main__ import MODULES

    return MODULES


@pytest.mark.slow
def test_quick_run_fills_its_tables_with_numbers(quick_output: str) -> None:
    tables = parse_tables(quick_output)
    for prefix in EXPECTED_TABLES:
        matching = [t for t in tables if t.startswith(prefix)]
        assert matching, f"no table titled {prefix!r} in:\n{list(tables)}"
        rows = tables[matching[0]]
        assert rows, f"table {matching[0]!r} has no rows"
        numeric = [c for row in rows for c in row[1:] if NUMBER.match(c)]
        assert numeric, f"table {matching[0]!r} has no figures: {rows}"


@pytest.mark.slow
def test_quick_run_reports_the_accuracy_of_the_counter(quick_output: str) -> None:
    tables = parse_tables(quick_output)
    title = next(t for t in tables if t.startswith("Energy error over the whole"))
    rows = {r[0]: r[1:] for r in tables[title]}
    ours = rows["gpu-energy-exporter counter, at its sample times"]
    steady = float(ours[0].split()[0].rstrip("%"))  # "mean (worst phase)"
    # Not a timing: the counter is exact on the fake library, so on a steady trace over the whole run
    # the error can only come from timestamp placement (a few ms of a multi-second run).
    assert abs(steady) < 2.0, rows


def test_trapezoid_and_rectangle_integration() -> None:
    polls = [(10.0, [100_000.0, 0.0]), (10.5, [100_000.0, 200_000.0]), (11.0, [300_000.0, 200_000.0])]
    trap = accuracy.integrate(polls, "trapezoid")
    assert trap.at(11.0, 0) == pytest.approx(50.0 + 100.0)  # 100 W for 0.5 s, then 100->300 W for 0.5 s
    assert trap.at(11.0, 1) == pytest.approx(50.0 + 100.0)
    assert trap.at(10.7, 0) == pytest.approx(50.0)  # the last reading at or before 10.7 s
    assert trap.at(9.0, 0) is None
    rect = accuracy.integrate(polls, "rectangle")
    assert rect.at(11.0, 0) == pytest.approx(50.0 + 150.0)  # each reading covers the interval before it


def test_cumulative_tolerance_counts_a_scrape_just_after_the_edge() -> None:
    cum = accuracy.Cumulative([1.0, 2.003, 3.002], [[0.0], [10.0], [20.0]], tolerance=0.2)
    assert cum.at(2.0, 0) == 10.0
    assert cum.at(3.0, 0) == 20.0
    assert accuracy.Cumulative(cum.times, cum.values).at(2.0, 0) == 0.0


def test_windows_tile_the_run_at_every_phase_without_running_past_it() -> None:
    wins = accuracy._windows(100.0, 107.0)
    phases = len(accuracy.OFFSETS)
    assert len(wins["1 s"]) == 6 * phases and len(wins["5 s"]) == phases and len(wins["run"]) == phases
    assert wins["1 s"][0] == (100.0, 101.0)
    assert wins["5 s"][0] == (100.0, 105.0)
    assert wins["run"][0] == (100.0, 106.0)
    assert all(b - a == pytest.approx(1.0) for a, b in wins["1 s"])
    assert max(b for _, b in wins["run"]) <= 107.0


def test_profiled_profiles_every_thread_by_group(tmp_path: Path) -> None:
    """bench.profiled: a worker thread's work lands in its own group's .prof, and top() lists it."""
    (tmp_path / "busy_mod.py").write_text(
        "import threading\n"
        "def spin_in_worker():\n"
        "    return sum(i * i for i in range(200_000))\n"
        "for k in range(2):\n"
        "    t = threading.Thread(target=spin_in_worker, name=f'worker-{k}')\n"
        "    t.start(); t.join()\n"
    )
    out = tmp_path / "prof"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    proc = subprocess.run([sys.executable, "-m", "bench.profiled", str(out), "busy_mod"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in out.glob("*.prof")} >= {"worker.prof", "main.prof", "all.prof"}
    from bench import profiled

    text = profiled.top(out / "worker.prof", 5)
    assert "spin_in_worker" in text
    assert "threading.py" not in text  # the wrapper frames are left out
    assert "spin_in_worker" not in profiled.top(out / "main.prof", 50)
    assert profiled.group_of("otlp-conn") == "otlp-conn"
    assert profiled.group_of("Thread-12 (target)") == "Thread"


def test_static_server_serves_the_posted_bytes() -> None:
    child = Child([sys.executable, "-m", "bench.static_server"], name="static")
    with child:
        url = child.wait_for("listening on", 30).split(" on ", 1)[1]
        assert url.startswith("http://127.0.0.1:")
        client = harness.HTTPClient(url + "/metrics")
        body = b"# HELP x y\nx 1\n" * 1000
        status, _, _ = client.request("POST", "/body", body, {"Content-Type": "text/plain"})
        assert status == 204
        for _ in range(3):  # keep-alive: the same connection answers again
            status, got, _ = client.get()
            assert (status, got) == (200, body)
        client.close()


def test_percentile_and_table_rendering() -> None:
    assert harness.percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert harness.percentile([5.0], 99) == 5.0
    t = harness.Table("T", ["name", "value"])
    t.add("a", 1.5)
    t.add("bb", 12345)
    text = t.render()
    assert "### T" in text
    assert "|  12,345 |" in text or "| 12,345 |" in text
    assert "-:|" in text  # the numeric column is right-aligned
    with pytest.raises(ValueError):
        t.add("only one cell")
