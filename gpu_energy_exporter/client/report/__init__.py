"""``gpu-energy-exporter report RUN...``: a per-run report (Markdown and a self-contained HTML page) with
PNG plots, or a comparison report for several runs (for example one backend against another).

Where the data comes from, for each RUN:

- a JSON summary file the run ledger wrote (``<dir of --runs.csv>/runs/<run id>.json``): pass its path;
- a running exporter (``--url``, default ``$GPU_ENERGY_EXPORTER_URL`` or ``http://localhost:9863``): its
  ``/api/v1/run?id=RUN``, the ledger's summary and bounded timeline of active and recent runs;
- a Prometheus server (``--prometheus URL``) that scraped the exporter: the run's time span from the
  ledger's ``gpuenergy_run_*`` series (else from ``training_run_finished``), then ``query_range`` over it
  for the ``gpuenergy_gpu_*`` and ``training_*`` series of the run's GPUs and exporter instance. The
  summary uses the ledger's own figures when Prometheus has them, else computes them from the samples
  (and says so).

Plots (matplotlib with the Agg backend, imported only by ``plots`` and only when plotting): power over time per
GPU, energy per step, loss against cumulative energy, VRAM and host memory over time, tokens/s; with
several runs also bar charts of J/token, tokens/s, energy and average power, and the loss-against-energy
curves overlaid. The summary numbers are the ledger's (``report.json`` holds exactly what was printed).

The command only reads from the exporter or Prometheus and writes only under ``--out``; it never calls
NVML and never changes the ledger.

The package, by job: ``run`` (the data of one run), ``sources`` (ledger JSON file, exporter JSON API),
``prometheus`` (the PromQL source), ``series`` (pure derived series), ``plots`` (PNG), ``render``
(Markdown and HTML), ``cli`` (flags, ``main``, writing the report directory). This ``__init__`` only names
the public API.
"""

from __future__ import annotations

from gpu_energy_exporter.client.report.cli import main, new_parser, safe_name, write_report
from gpu_energy_exporter.client.report.plots import (
    PLOT_DPI,
    PLOT_SIZE_IN,
    PLOTS,
    load_pyplot,
    plot_comparison,
    plot_run,
)
from gpu_energy_exporter.client.report.prometheus import PrometheusSource
from gpu_energy_exporter.client.report.render import summary_rows
from gpu_energy_exporter.client.report.run import ReportError, RunData
from gpu_energy_exporter.client.report.series import energy_per_step, loss_vs_energy, tokens_per_second
from gpu_energy_exporter.client.report.sources import (
    SUMMARY_SCHEMA,
    from_ledger_document,
    load_file,
    load_from_exporter,
)

__all__ = [
    "PLOTS", "PLOT_DPI", "PLOT_SIZE_IN", "SUMMARY_SCHEMA", "PrometheusSource", "ReportError", "RunData",
    "energy_per_step", "from_ledger_document", "load_file", "load_from_exporter", "load_pyplot", "loss_vs_energy",
    "main", "new_parser", "plot_comparison", "plot_run", "safe_name", "summary_rows", "tokens_per_second",
    "write_report",
]
