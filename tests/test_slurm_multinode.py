"""A multi-node Slurm job in the run ledger (issue 23): each node's exporter charges the job for its own GPUs
and writes its own row (its part); ``runs --prometheus`` sums the nodes' per-run series by run id, which is
the job id, into the whole job.

Two exporters (two "nodes", simulated GPUs) in this process, each with ``--collector.slurm`` on its own
job-mapping directory, in which the test writes what the shipped prolog writes on each node (the file of
the GPU the job holds, listing the job id) and removes it as the epilog does; a real Prometheus scrapes
both. The job pushes nothing. Truth: the sum of the two nodes' own ledger rows.
"""

from __future__ import annotations

import io
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import sample_value, wait_until
from prom import Prometheus

from gpu_energy_exporter.client import runs as runs_cli
from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend

JOB = "4242"


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _rows(url: str) -> list[dict[str, Any]]:
    return [r for r in _get(url + "/api/v1/runs")["runs"] if r["run_id"] == JOB]


def _served(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        value = sample_value(r.read().decode(), runs_schema.RUN_ENERGY.name, run_id=JOB)
    assert value is not None
    return value


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[list[str], list[Path], Prometheus]]:
    exporters: list[Exporter] = []
    prom: Prometheus | None = None
    try:
        maps = [tmp_path / f"map-{i}" for i in range(2)]
        for i, load in enumerate((1.0, 0.3)):  # the nodes draw differently: one node's row is not the job
            backend = SimulatedBackend(1)
            backend.set_load(0, load)
            maps[i].mkdir()
            config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                                  "--otlp.grpc.listen-address=127.0.0.1:0",
                                  "--collector.interval=250ms", "--collector.slurm",
                                  f"--collector.slurm.job-mapping-dir={maps[i]}",
                                  f"--runs.csv={tmp_path / f'runs-{i}.csv'}"], {})
            exp = Exporter(config, backend_factory=lambda b=backend: b)  # type: ignore[misc]
            exp.start()
            exporters.append(exp)
        urls = [e.web.url for e in exporters if e.web is not None]
        prom = Prometheus(tmp_path / "prom", [u.removeprefix("http://") for u in urls], interval="1s")
        wait_until(lambda: prom is not None and len(prom.query("up == 1")) == 2, timeout=30,
                   what="both exporters scraped")
        yield urls, maps, prom
    finally:
        if prom is not None:
            prom.stop()
        for exp in exporters:
            exp.stop()


def test_a_multi_node_job_is_one_row_per_node_and_runs_prometheus_sums_them(
        nodes: tuple[list[str], list[Path], Prometheus]) -> None:
    urls, maps, prom = nodes
    for m in maps:  # the prolog on each node: the job holds GPU 0 there
        (m / "0").write_text(f"{JOB}\n")
    for url in urls:
        wait_until(lambda url=url: _rows(url), timeout=30, what="the job's run on both nodes")
    wait_until(lambda: all((_rows(u)[0]["energy_j"] or 0) > 0 for u in urls), timeout=30, what="energy on both nodes")
    for m in maps:  # the epilog
        (m / "0").unlink()
    rows = [wait_until(lambda url=url: (r := _rows(url)) and r[0]["status"] == "finished" and r, timeout=30,
                       what="the job's run finished on both nodes")[0] for url in urls]
    assert all(len(_rows(u)) == 1 for u in urls)
    served = [_served(u) for u in urls]
    wait_until(lambda: sum(float(s["value"][1]) for s in prom.query(
        f'{runs_schema.RUN_ENERGY.name}{{run_id="{JOB}"}}')) == sum(served), timeout=20,
        what="Prometheus to scrape both ledgers' final figures")
    out, err = io.StringIO(), io.StringIO()
    rc = runs_cli.main(["--prometheus", prom.url, "--since", "10m", "--format", "json"], stdout=out, stderr=err,
                       environ={})
    assert rc == 0, err.getvalue()
    [whole] = [r for r in json.loads(out.getvalue())["runs"] if r["run_id"] == JOB]
    assert whole["nodes"] == 2  # (both simulated nodes' GPU 0 have the same UUID: gpu_count says 1)
    assert whole["energy_j"] == pytest.approx(sum(served))
    assert whole["energy_j"] == pytest.approx(rows[0]["energy_j"] + rows[1]["energy_j"], rel=0.02)
    assert rows[0]["energy_j"] < whole["energy_j"] * 0.9  # one node's row is its part only
    print(f"\n[issue 23] multi-node job: node rows {rows[0]['energy_j']:.1f} J + {rows[1]['energy_j']:.1f} J, "
          f"runs --prometheus {whole['energy_j']:.1f} J over {whole['nodes']} nodes")
