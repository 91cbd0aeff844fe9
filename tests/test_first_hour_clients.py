"""A new user's first hour with the workstation commands (issue 22): what `report` draws in its memory plot,
MFU shown by `top`, `report.md` and `report.html`, where `report` writes, and the demo's banner."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

from gpu_energy_exporter.client import report, top
from gpu_energy_exporter.client.fmt import GIB
from gpu_energy_exporter.tools.demo import DemoOptions, next_steps

T0 = 1_700_000_000.0
#: Two 80 GiB GPUs, one at 59 GiB and one at 49 GiB used: what the demo showed (the plot drew their sum,
#: 108 GiB, against one GPU's 80 GiB total, while the table said 59 GiB peak).
TOTAL = 80 * GIB


def _document(mfu: float | None = 0.4125) -> dict[str, Any]:
    used = [(59 * GIB, 49 * GIB), (58 * GIB, 48 * GIB), (57 * GIB, 47 * GIB)]
    return {
        "run_id": "two-gpus", "schema": report.SUMMARY_SCHEMA, "start_unix": T0, "end_unix": T0 + 120,
        "duration_s": 120.0, "energy_j": 72_000.0, "tokens": 12_000.0, "j_per_token": 6.0, "tokens_per_s": 100.0,
        "mfu": mfu, "vram_peak_bytes": 59 * GIB, "vram_avg_bytes": 53 * GIB, "vram_total_bytes": TOTAL,
        "gpus": [{"uuid": "GPU-a", "name": "A"}, {"uuid": "GPU-b", "name": "B"}], "timeline_gpus": ["GPU-a", "GPU-b"],
        # the ledger's timeline holds memory summed over the run's GPUs
        "timeline": [{"t": T0 + 40 * i, "power_w": [300.0, 300.0], "energy_j": 24_000.0 * i, "tokens": 4000.0 * i,
                      "steps": 10.0 * i, "loss": 2.0 - 0.1 * i, "vram_used_bytes": a + b}
                     for i, (a, b) in enumerate(used)],
    }


class _Keep:
    """matplotlib.pyplot, keeping every figure it makes, so the test can read what was drawn (the data of
    each line, not pixels); closing a figure leaves its artists readable."""

    def __init__(self, plt: Any) -> None:
        self._plt, self.figures = plt, []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plt, name)

    def subplots(self, *args: Any, **kwargs: Any) -> Any:
        fig, ax = self._plt.subplots(*args, **kwargs)
        self.figures.append(fig)
        return fig, ax


def test_the_memory_plot_draws_per_gpu_memory_against_one_gpus_total(tmp_path: Path) -> None:
    run = report.from_ledger_document(_document(), "test")
    plt = _Keep(report.load_pyplot())
    paths = report.plot_run(run, str(tmp_path), plt)
    assert Path(paths["memory"]).is_file()
    memory = next(f for f in plt.figures if f.get_suptitle().startswith("Memory"))
    lines = {line.get_label(): list(line.get_ydata()) for line in memory.axes[0].get_lines()}
    used = next(v for k, v in lines.items() if k.startswith("VRAM used"))
    total = next(v for k, v in lines.items() if k.startswith("VRAM total"))
    peak = next(v for k, v in lines.items() if k.startswith("VRAM peak"))
    # (59 + 49) / 2 = 54, (58 + 48) / 2 = 53, (57 + 47) / 2 = 52 GiB per GPU; before: 108, 106, 104
    assert used == pytest.approx([54.0, 53.0, 52.0])
    assert set(total) == {80.0} and set(peak) == {59.0}
    assert max(used) <= peak[0] <= total[0], "used must never stand above the total it is drawn against"
    assert "VRAM used per GPU (mean of 2) (GiB)" in lines


def test_report_md_and_html_show_mfu_and_say_where_they_went(tmp_path: Path) -> None:
    summary = tmp_path / "two-gpus.json"
    summary.write_text(json.dumps(_document()), encoding="utf-8")
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert report.main([str(summary)], stdout=out, stderr=err) == 0, err.getvalue()
    finally:
        os.chdir(cwd)
    where = tmp_path / "report-two-gpus"
    # Said before anything is written, as an absolute path, naming the current directory as the default.
    assert f"report: writing into {where}{os.sep} (the current directory; --out DIR to choose)" in err.getvalue()
    assert f"wrote {where / 'report.md'}" in out.getvalue()
    md = (where / "report.md").read_text(encoding="utf-8")
    html = (where / "report.html").read_text(encoding="utf-8")
    assert "| MFU (whole run) | 41.2% |" in md
    assert "<td>MFU (whole run)</td><td>41.2%</td>" in html


def test_a_run_without_mfu_says_so_with_a_dash(tmp_path: Path) -> None:
    run = report.from_ledger_document(_document(mfu=None), "test")
    assert dict(report.summary_rows(run))["MFU (whole run)"] == "-"


def test_top_shows_the_mfu_of_an_active_run() -> None:
    view = top.View(status={"gpus": [], "host": {}}, runs=[
        {"run_id": "r1", "status": "running", "model": "m", "precision": "bf16", "mfu": 0.4125, "steps": 5.0},
        {"run_id": "r2", "status": "running", "model": "m", "steps": 5.0}])
    text = top.frame_text(top.render_frame(view, url="http://localhost:9863", interval=2.0, width=120, now=T0))
    about = [line.rstrip() for line in text.splitlines() if line.startswith("  m")]
    assert about == ["  m · bf16 · MFU 41.2%", "  m"]


@pytest.mark.parametrize(("web_url", "flag"), [
    ("http://[::1]:9863", ""),  # the default listen address: what the demo printed --url for
    ("http://127.0.0.1:9863", ""),
    ("http://localhost:9863", ""),
    ("http://[::1]:9864", " --url http://[::1]:9864"),  # another port: the commands must be told
    ("http://192.0.2.7:9863", " --url http://192.0.2.7:9863"),
])
def test_the_demo_banner_passes_url_only_when_the_default_would_miss(web_url: str, flag: str) -> None:
    opts = DemoOptions(gpus=2, run_duration=180.0, pause=20.0, runs=0, export_interval=2.0)
    text = next_steps(web_url, "http://[::1]:4318", "/metrics", opts, None, 2)
    commands = [line.split()[:3] for line in text.splitlines() if line.strip().startswith("gpu-energy-exporter ")]
    assert [c[1] for c in commands] == ["top", "runs", "report"]
    for line in text.splitlines():
        if line.strip().startswith("gpu-energy-exporter "):
            assert ("--url" in line) is bool(flag), line
            if flag:
                assert flag.strip() in line
    # Finished runs leave /api/v1/runs after 15 minutes: the banner says so, and how to keep them.
    assert "finished runs stay in `runs` and `report` for 15 minutes; add --runs.csv=" in text


ROOT = Path(__file__).resolve().parent.parent


def test_readme_says_how_long_make_test_takes_and_what_it_keeps_where() -> None:
    from test_container import container_cache

    from gpu_energy_exporter.core.runs_schema import KEEP_FINISHED_S

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "about five minutes" not in readme  # it took 10 min 51 s on a fresh clone (issue 22)
    assert "about 15 minutes" in readme  # measured after issues 19-24 (README, "Development")
    # The caches it names are the ones the set-up and the tests use.
    default_cache = str(container_cache()).replace(str(Path.home()), "~") if "GEE_CONTAINER_CACHE" not in os.environ \
        else "~/.cache/gpu-energy-exporter/container"
    assert f"`{default_cache}/`" in readme and "`.venv/` in the checkout" in readme
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert "clean:\n\trm -rf $(VENV)" in makefile and "| `make clean` |" in readme
    # The demo path says how long finished runs stay.
    assert KEEP_FINISHED_S == 15 * 60 and "for 15 minutes after they end" in readme


def test_setup_announces_every_slow_step() -> None:
    # Long silent stretches looked like a hang: every apt-get and pip install is preceded by a `step` line.
    lines = (ROOT / ".ci" / "setup-test-env").read_text(encoding="utf-8").splitlines()
    slow = [i for i, line in enumerate(lines) if ("pip\" install" in line or "pip install" in line
                                                  or "apt-get update" in line) and not line.lstrip().startswith("#")]
    assert len(slow) >= 4
    for i in slow:
        before = [line for line in lines[max(0, i - 3):i] if line.strip().startswith("step ")]
        assert before, f"line {i + 1} runs without announcing itself: {lines[i].strip()}"
