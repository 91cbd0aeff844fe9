"""``gpu-energy-exporter report``: files, PNGs that decode at the expected size and carry the data, summary
numbers equal to the ledger's; from the exporter's API, from a ledger JSON summary, and from a real
Prometheus that scraped the exporter."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, free_port, wait_until
from PIL import Image, ImageStat
from prom import Prometheus

from gpu_energy_exporter.client import report
from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.core.textfmt import fmt_num
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend
from gpu_energy_exporter.tools.demo import SimulatedTrainer

EXPECTED_SIZE = (int(report.PLOT_SIZE_IN[0] * report.PLOT_DPI), int(report.PLOT_SIZE_IN[1] * report.PLOT_DPI))
#: Figures the report prints that must be the ledger's own numbers.
LEDGER_KEYS = ("energy_j", "energy_kwh", "avg_power_w", "peak_power_w", "j_per_token", "energy_per_10k_tokens_j",
               "tokens", "tokens_per_s", "co2_g", "duration_s", "vram_peak_bytes")


@dataclass
class Runs:
    exporter: Exporter
    url: str
    csv: Path
    run_ids: list[str]
    prometheus: Prometheus | None


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    """Two finished runs (bitsandbytes, then unsloth profiles) pushed through OTLP by the real training helper
    to an exporter on simulated GPUs; a real Prometheus scrapes it every second when installed."""
    d = tmp_path_factory.mktemp("report-runs")
    csv_path = d / "runs.csv"
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=",  # the suite never binds the default 4317
                          "--collector.interval=250ms", "--runs.warmup=1s", f"--runs.csv={csv_path}"], {})
    backend = SimulatedBackend(2)
    exporter = Exporter(config, backend_factory=lambda: backend)
    exporter.start()
    assert exporter.web is not None
    url = exporter.web.url
    prom = None
    try:
        try:
            prom = Prometheus(d / "prom", [url.removeprefix("http://")], interval="1s")
        except pytest.skip.Exception:
            prom = None
        if prom is not None:
            # The runs must happen while Prometheus is scraping, or it has nothing of their start.
            wait_until(lambda: prom is not None and prom.query("up == 1"), timeout=30, what="the first scrape")
        host, port = exporter.otlp.server_address
        trainer = SimulatedTrainer(backend, [g.uuid for g in backend.devices()], f"http://{host}:{port}",
                                   run_duration=4.0, pause=1.0, runs=2, export_interval=0.3, seed=7).start()
        assert trainer.done.wait(60), "the simulated trainer did not finish its runs"
        trainer.stop()
        ids = list(trainer.started_runs)
        assert len(ids) == 2
        wait_until(lambda: all(any(r["run_id"] == i and r["status"] == "finished"
                                   for r in _get(url + "/api/v1/runs")["runs"]) for i in ids),
                   timeout=20, what="both runs finished in the ledger")
        yield Runs(exporter, url, csv_path, ids, prom)
    finally:
        if prom is not None:
            prom.stop()
        exporter.stop()


def _ledger(runs: Runs, run_id: str) -> dict[str, Any]:
    doc: dict[str, Any] = _get(runs.url + "/api/v1/run?id=" + run_id)
    return doc


def _check_png(path: Path, min_colour_pixels: int = 0, colour: tuple[int, int, int] | None = None) -> None:
    with Image.open(path) as img:
        assert img.format == "PNG"
        assert img.size == EXPECTED_SIZE, (path, img.size)
        rgb = img.convert("RGB")
        assert ImageStat.Stat(rgb.convert("L")).var[0] > 50, f"{path} is blank"
        colours = rgb.getcolors(1 << 20) or []
        assert len(colours) > 20, f"{path} has almost no colours"
        if colour is not None:
            near = sum(n for n, c in colours if sum(abs(a - b) for a, b in zip(c, colour, strict=True)) < 60)
            assert near >= min_colour_pixels, f"{path}: only {near} pixels of the data colour {colour}"


def _report(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = report.main(args, stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_single_run_report_from_the_exporter(runs: Runs, tmp_path: Path) -> None:
    run_id = runs.run_ids[0]
    out = tmp_path / "one"
    rc, stdout, stderr = _report([run_id, "--url", runs.url, "--out", str(out)])
    assert rc == 0, stderr
    assert "report: fetching run" in stderr and "report: plotting" in stderr  # progress on stderr
    assert "[SIMULATED DATA]" in stdout
    for name in ("report.md", "report.html", "report.json"):
        assert (out / name).is_file()
    plot_dir = out / report.safe_name(run_id)
    for name, _ in report.PLOTS:
        _check_png(plot_dir / f"{name}.png")
    # The data is drawn, not only the axes: matplotlib's first two colours are the two GPUs' power lines.
    _check_png(plot_dir / "power.png", 400, (31, 119, 180))
    _check_png(plot_dir / "power.png", 400, (255, 127, 14))
    _check_png(plot_dir / "loss_vs_energy.png", 300, (27, 158, 119))

    ledger = _ledger(runs, run_id)
    doc = json.loads((out / "report.json").read_text())
    summary = doc["runs"][0]["summary"]
    for key in LEDGER_KEYS:
        assert summary[key] == ledger[key], key
    assert doc["runs"][0]["simulated"] is True
    md = (out / "report.md").read_text()
    assert f"| J/token (after a 1 s warm-up) | {fmt_num(ledger['j_per_token'])} |" in md
    assert f"{ledger['energy_kwh']:.4g} kWh ({ledger['energy_j']:,.0f} J)" in md
    assert f"| peak power | {ledger['peak_power_w']:,.0f} W |" in md
    assert f"| average power | {ledger['avg_power_w']:,.0f} W |" in md
    assert "energy per 10k tokens" in md and "| CO2 |" in md and "SIMULATED DATA" in md
    for name, _ in report.PLOTS:
        assert f"]({report.safe_name(run_id)}/{name}.png)" in md
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == len(report.PLOTS)
    assert "<img" in page and 'src="' + report.safe_name(run_id) not in page  # self-contained


def test_comparison_report_of_two_backends(runs: Runs, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    rc, _, stderr = _report([*runs.run_ids, "--url", runs.url, "--out", str(out)])
    assert rc == 0, stderr
    _check_png(out / "comparison.png")
    _check_png(out / "comparison_loss_vs_energy.png")
    a, b = (_ledger(runs, i) for i in runs.run_ids)
    assert (a["backend"], b["backend"]) == ("bitsandbytes", "unsloth")
    md = (out / "report.md").read_text()
    assert "## Comparison" in md
    assert f"J/token {b['j_per_token'] / a['j_per_token']:.2f}x" in md
    header = next(line for line in md.splitlines() if line.startswith("|  |"))
    assert runs.run_ids[0] in header and runs.run_ids[1] in header
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 * len(report.PLOTS) + 2
    for run_id in runs.run_ids:
        assert (out / report.safe_name(run_id) / "memory.png").is_file()


def test_comparison_bars_carry_their_values(tmp_path: Path) -> None:
    # Issue 31 item 9: the comparison bars had no value labels (two backends 3% apart looked equal).
    from test_first_hour_clients import _document, _Keep

    docs = [_document(), {**_document(), "run_id": "other", "j_per_token": 5.82, "tokens_per_s": 1234.5,
                          "energy_kwh": 0.0312, "avg_power_w": None}]
    docs[0].update(energy_kwh=0.02, avg_power_w=612.4)
    runs = [report.from_ledger_document(d, "test") for d in docs]
    plt = _Keep(report.load_pyplot())
    report.plot_comparison(runs, str(tmp_path), plt)
    bars = next(f for f in plt.figures if f.get_suptitle().startswith("Runs compared"))
    labels = {ax.get_title(): [t.get_text() for t in ax.texts] for ax in bars.axes}
    assert labels == {"J/token": ["6.00", "5.82"], "tokens/s": ["100", "1,234"],
                      "energy (kWh)": ["0.0200", "0.0312"], "average power (W)": ["612", "-"]}, labels
    for ax in bars.axes:  # every label sits inside the axes, above its bar
        top = ax.get_ylim()[1]
        assert all(p.get_height() < top for p in ax.patches)


def test_report_from_the_ledgers_json_summary(runs: Runs, tmp_path: Path) -> None:
    run_id = runs.run_ids[1]
    summary_file = runs.csv.parent / "runs" / f"{run_id}.json"
    assert summary_file.is_file()
    out = tmp_path / "file"
    # No exporter needed: the URL points nowhere.
    rc, _, stderr = _report([str(summary_file), "--url", f"http://127.0.0.1:{free_port()}", "--out", str(out)])
    assert rc == 0, stderr
    summary = json.loads((out / "report.json").read_text())["runs"][0]["summary"]
    ledger = json.loads(summary_file.read_text())
    for key in LEDGER_KEYS:
        assert summary[key] == ledger[key], key
    _check_png(out / report.safe_name(run_id) / "tokens_per_s.png", 200, (102, 166, 30))


def test_errors_say_what_to_do(runs: Runs, tmp_path: Path) -> None:
    rc, _, err = _report(["no-such-run", "--url", runs.url, "--out", str(tmp_path / "x")])
    assert rc == 2 and "unknown run 'no-such-run'" in err and "JSON summary" in err
    rc, _, err = _report(["some-run", "--url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "y")])
    assert rc == 2 and "nothing listens at" in err and "is the exporter running?" in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something/else", "run_id": "r"}')
    rc, _, err = _report([str(bad), "--out", str(tmp_path / "z")])
    assert rc == 2 and "schema" in err


def test_missing_matplotlib_says_how_to_install_it(tmp_path: Path) -> None:
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from gpu_energy_exporter.daemon.cli import main\n"
            f"sys.exit(main(['report', 'r', '--out', {str(tmp_path / 'o')!r}]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2
    assert "-m pip install 'matplotlib>=3.7'" in out.stderr and "Traceback" not in out.stderr


def _colour_columns(path: Path, colour: tuple[int, int, int]) -> list[int]:
    with Image.open(path) as img:
        rgb = img.convert("RGB")
        w, h = rgb.size
        px = rgb.load()
        return [x for x in range(w) if any(sum(abs(a - b) for a, b in zip(px[x, y], colour, strict=True)) < 40
                                           for y in range(h))]


def test_a_run_without_energy_and_few_samples_is_drawn_honestly(tmp_path: Path) -> None:
    # Issue 12: a run with no energy drew a vertical line at 0 J on a -0.04…0.04 J axis, and its power plot
    # stretched 5 s of samples across a 26 s run.
    t0 = 1_700_000_000.0
    doc = {"run_id": "no-energy", "schema": report.SUMMARY_SCHEMA, "start_unix": t0, "end_unix": t0 + 26,
           "duration_s": 26.0, "energy_j": 0.0, "gpus": [{"uuid": "GPU-a", "name": "A"}], "timeline_gpus": ["GPU-a"],
           "timeline": [{"t": t0 + 21 + i, "power_w": [100.0 + 10 * i], "energy_j": 0.0, "tokens": 100.0 * i,
                         "steps": float(i), "loss": 2.0 - 0.1 * i} for i in range(6)]}
    run = report.from_ledger_document(doc, "test")
    paths = report.plot_run(run, str(tmp_path), report.load_pyplot())
    assert _colour_columns(Path(paths["loss_vs_energy"]), (27, 158, 119)) == []  # no line at all
    blue = _colour_columns(Path(paths["power"]), (31, 119, 180))  # matplotlib's first line colour
    assert blue, "the power samples are drawn"
    width = EXPECTED_SIZE[0]
    assert max(blue) - min(blue) < 0.35 * width, "5 s of samples must not fill the axis of a 26 s run"
    assert min(blue) > 0.55 * width, "the samples sit at the end of the run, where they were taken"


@pytest.mark.slow
def test_report_from_prometheus_matches_the_ledger(runs: Runs, tmp_path: Path) -> None:
    if runs.prometheus is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    prom = runs.prometheus
    run_id = runs.run_ids[0]
    ledger = _ledger(runs, run_id)
    # Prometheus has the run once it scraped the ledger's final figures.
    energy = runs_schema.RUN_ENERGY.name
    wait_until(lambda: prom.value(f'{energy}{{run_id="{run_id}"}}') == ledger["energy_j"],
               timeout=20, what="Prometheus to scrape the finished run")
    out = tmp_path / "prom"
    rc, _, stderr = _report([run_id, "--prometheus", prom.url, "--since", "10m", "--out", str(out)])
    assert rc == 0, stderr
    assert "querying" in stderr
    doc = json.loads((out / "report.json").read_text())
    r = doc["runs"][0]
    assert r["source"] == f"Prometheus {prom.url}"
    for key in ("energy_j", "j_per_token", "tokens", "tokens_per_s", "avg_power_w", "peak_power_w", "co2_g",
                "duration_s", "vram_peak_bytes", "mfu"):
        assert r["summary"][key] == ledger[key], key
    assert 0 < r["summary"]["mfu"] < 1  # the report's MFU row reads it (issue 22)
    assert r["summary"]["backend"] == "bitsandbytes" and r["summary"]["status"] == "finished"
    assert r["simulated"] is True
    assert any("the run ledger's" in n for n in r["notes"])
    plot_dir = out / report.safe_name(run_id)
    for name, _ in report.PLOTS:
        _check_png(plot_dir / f"{name}.png")
    _check_png(plot_dir / "power.png", 300, (31, 119, 180))
    _check_png(plot_dir / "loss_vs_energy.png", 100, (27, 158, 119))
    # The span comes from the ledger's duration series: exact, not rounded to the scrape interval.
    assert abs(json.loads((out / "report.json").read_text())["runs"][0]["summary"]["duration_s"]
               - ledger["duration_s"]) < 1e-6
    rc, _, err = _report(["not-a-run", "--prometheus", prom.url, "--since", "10m", "--out", str(tmp_path / "n")])
    assert rc == 2 and "not found in Prometheus" in err


def test_rates_are_averaged_over_windows() -> None:
    run = report.RunData("r", "test", {"warmup_s": 0.0})
    # Snapshots every second; the counter moves at exports every 2 s by 200 tokens: 100 tokens/s.
    run.t = [float(i) for i in range(21)]
    run.tokens = [float(200 * (i // 2)) for i in range(21)]
    run.steps = [float(i // 2) for i in range(21)]
    run.energy_j = [50.0 * i for i in range(21)]
    rates = report.tokens_per_second(run)
    assert rates and all(v == pytest.approx(100.0) for _, _, v in rates)
    assert all(end - start >= 5.0 for start, end, _ in rates)
    eps = report.energy_per_step(run)
    assert eps and all(j == pytest.approx(100.0) for _, j in eps)  # 50 W x 2 s per step
    losses = [3.0 - 0.1 * (i // 2) for i in range(21)]
    run.loss = list(losses)
    curve = report.loss_vs_energy(run)
    assert [loss for _, loss in curve] == sorted(set(losses), reverse=True)

