"""Issue 19 item 7: a multi-node run in every client. Two exporters (two "nodes", simulated GPUs) each get
two of a 4-rank run's ranks through the real training helper (OpenTelemetry SDK, OTLP/HTTP); a real
Prometheus scrapes both.

- ``runs --url`` on one node marks the run "(2 of 4 ranks on this node)"; ``top`` and ``report`` say so.
- ``runs --prometheus`` gives the whole run: tokens of all 4 ranks, both nodes' energy and CO2, and J/token
  = both ledgers' post-warm-up energy over both ledgers' post-warm-up tokens.

Truth: every rank pushes 5 steps of 1,000 tokens (20,000 tokens in all, 10,000 per node); the energy of
each node is what its own ledger measured (both ledgers are read back through their JSON API).
"""

from __future__ import annotations

import io
import json
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import wait_until
from prom import Prometheus

from gpu_energy_exporter.client import runs as runs_cli
from gpu_energy_exporter.client.report.render import summary_rows
from gpu_energy_exporter.client.report.run import RunData
from gpu_energy_exporter.client.top.frame import _run_lines, frame_text
from gpu_energy_exporter.core import runs_schema
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend
from gpu_energy_exporter.training import start_run

RUN = "mn-run"
STEPS, TOKENS_PER_STEP = 5, 1000


@dataclass
class Nodes:
    exporters: list[Exporter]
    urls: list[str]
    prometheus: Prometheus | None


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _ledger(url: str) -> dict[str, Any]:
    doc: dict[str, Any] = _get(url + "/api/v1/run?id=" + RUN)
    return doc


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    d = tmp_path_factory.mktemp("multinode")
    exporters: list[Exporter] = []
    prom: Prometheus | None = None
    try:
        backends = [SimulatedBackend(2), SimulatedBackend(2)]
        # Node A's GPUs work hard, node B's idle: the nodes' J/token differ, as on a real job whose nodes
        # are not alike, so one node's figure is not the run's.
        backends[0].set_load(0, 1.0)
        backends[0].set_load(1, 1.0)
        for i, backend in enumerate(backends):
            config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                                  "--otlp.grpc.listen-address=",  # the suite never binds the default 4317
                                  "--collector.interval=250ms", "--runs.warmup=0s",
                                  f"--runs.csv={d / f'runs-{i}.csv'}"], {})
            exp = Exporter(config, backend_factory=lambda b=backend: b)  # type: ignore[misc]
            exp.start()
            exporters.append(exp)
        urls = [e.web.url for e in exporters if e.web is not None]
        try:
            prom = Prometheus(d / "prom", [u.removeprefix("http://") for u in urls], interval="1s")
            wait_until(lambda: prom is not None and len(prom.query("up == 1")) == 2, timeout=30,
                       what="both exporters scraped")
        except pytest.skip.Exception:
            prom = None
        ranks = []
        for rank in range(4):
            node = rank // 2
            backend, exp = backends[node], exporters[node]
            host, port = exp.otlp.server_address
            uuid = backend.devices()[rank % 2].uuid
            ranks.append(start_run(RUN, rank=rank, world_size=4, gpu_uuids=[uuid], backend="fsdp",
                                   endpoint=f"http://{host}:{port}", export_interval=0.3, environ={}))
        for _ in range(STEPS):
            for r in ranks:
                r.step(tokens=TOKENS_PER_STEP)
            threading.Event().wait(0.5)  # a step takes time: snapshots (and energy) pass between steps
        for r in ranks:
            r.finish()
        for url in urls:
            wait_until(lambda url=url: any(r["run_id"] == RUN and r["status"] == "finished"
                                           for r in _get(url + "/api/v1/runs")["runs"]),
                       timeout=30, what="the run finished in both ledgers")
        yield Nodes(exporters, urls, prom)
    finally:
        if prom is not None:
            prom.stop()
        for exp in exporters:
            exp.stop()


def _served(url: str, spec: Any) -> float:
    """A per-run counter as the exporter serves it on /metrics (held at the highest value served: a run
    closed after a snapshot past its end serves a little more than its summary; ledger/specs.py)."""
    from helpers import sample_value

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        value = sample_value(r.read().decode(), spec.name, run_id=RUN)
    assert value is not None, spec.name
    return value


def _whole(nodes: Nodes, spec: Any) -> float:
    return sum(_served(u, spec) for u in nodes.urls)


def _scraped(prom: Prometheus, nodes: Nodes) -> None:
    """Wait until Prometheus holds what both exporters serve now for the run's counters."""
    specs = (runs_schema.RUN_ENERGY, runs_schema.RUN_WINDOW_ENERGY, runs_schema.RUN_WINDOW_TOKENS)

    def same() -> bool:
        return all(sum(float(s["value"][1]) for s in prom.query(f'{spec.name}{{run_id="{RUN}"}}'))
                   == _whole(nodes, spec) for spec in specs)

    wait_until(same, timeout=20, what="Prometheus to scrape both ledgers' final figures")


def _runs(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = runs_cli.main(argv, stdout=out, stderr=err, environ={})
    return rc, out.getvalue(), err.getvalue()


def test_one_node_says_it_sees_two_of_four_ranks_in_every_client(nodes: Nodes) -> None:
    rc, out, err = _runs(["--url", nodes.urls[0]])
    assert rc == 0, err
    row = next(line for line in out.splitlines() if line.startswith(RUN))
    # the first column stays the bare id (copyable into `report`); the marks are on the status
    assert row.split()[0] == RUN and row.endswith("(SIMULATED) (2 of 4 ranks on this node)")
    assert "10,000" in row.split()  # this node's two ranks: 2 x 5 x 1,000 tokens
    assert "The whole run: runs --prometheus URL" in out
    summary = _ledger(nodes.urls[0])
    assert summary["ranks"] == 2 and summary["world_size"] == "4"
    # top: the run line says so; report: the summary's first row.
    lines = frame_text(_run_lines([summary], 160))
    assert "2 of 4 ranks on this node: figures cover those ranks only" in lines
    rows = summary_rows(RunData(RUN, "test", summary))
    assert rows[0][0] == "coverage" and rows[0][1].startswith("2 of 4 ranks on this node")


def test_runs_from_prometheus_are_whole_runs(nodes: Nodes) -> None:
    prom = nodes.prometheus
    if prom is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    ledgers = [_ledger(u) for u in nodes.urls]
    energy = runs_schema.RUN_ENERGY
    _scraped(prom, nodes)
    rc, out, err = _runs(["--prometheus", prom.url, "--since", "10m", "--format", "json"])
    assert rc == 0, err
    [whole] = [r for r in json.loads(out)["runs"] if r["run_id"] == RUN]
    assert whole["tokens"] == 4 * STEPS * TOKENS_PER_STEP == 20_000
    # --runs.warmup=0s: the window is the whole run, its tokens every token (under load a rank's late first
    # point once made the served window 16.5 tokens short, and J/token 0.08% high).
    assert _whole(nodes, runs_schema.RUN_WINDOW_TOKENS) == 20_000
    assert whole["nodes"] == 2 and whole["ranks"] == 4 and whole["world_size"] == "4"
    # The sums of both nodes' ledger counters, and (to a snapshot interval) of their summaries.
    assert whole["energy_j"] == pytest.approx(_whole(nodes, energy))
    assert whole["energy_j"] == pytest.approx(ledgers[0]["energy_j"] + ledgers[1]["energy_j"], rel=0.02)
    assert whole["co2_g"] == pytest.approx(_whole(nodes, runs_schema.RUN_CO2))
    truth = _whole(nodes, runs_schema.RUN_WINDOW_ENERGY) / _whole(nodes, runs_schema.RUN_WINDOW_TOKENS)
    assert whole["j_per_token"] == pytest.approx(truth)
    assert truth == pytest.approx((ledgers[0]["window_energy_j"] + ledgers[1]["window_energy_j"]) / (
        ledgers[0]["window_tokens"] + ledgers[1]["window_tokens"]), rel=0.02)
    # One node's J/token is not the run's (node A's GPUs drew more than node B's).
    assert ledgers[0]["j_per_token"] > truth * 1.05
    rc, table, err = _runs(["--prometheus", prom.url, "--since", "10m"])
    assert rc == 0, err
    row = next(line for line in table.splitlines() if line.startswith(RUN))
    assert "ranks" not in row and "20,000" in row.split()


def test_report_from_prometheus_sums_the_nodes(nodes: Nodes, tmp_path: Path) -> None:
    prom = nodes.prometheus
    if prom is None:
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    from gpu_energy_exporter.client import report

    energy = runs_schema.RUN_ENERGY
    _scraped(prom, nodes)
    out, err = io.StringIO(), io.StringIO()
    rc = report.main([RUN, "--prometheus", prom.url, "--since", "10m", "--out", str(tmp_path / "r")],
                     stdout=out, stderr=err)
    assert rc == 0, err.getvalue()
    r = json.loads((tmp_path / "r" / "report.json").read_text())["runs"][0]
    assert r["summary"]["tokens"] == 20_000
    assert r["summary"]["energy_j"] == pytest.approx(_whole(nodes, energy))
    assert r["summary"]["j_per_token"] == pytest.approx(_whole(nodes, runs_schema.RUN_WINDOW_ENERGY) / 20_000)
    assert any("summed over the 2 exporters" in n for n in r["notes"])


@pytest.mark.parametrize(("row", "expected"), [
    ({"ranks": 2.0, "world_size": "4"}, "2 of 4 ranks on this node"),
    ({"ranks": 4.0, "world_size": "4"}, None),
    ({"ranks": 1.0, "world_size": None}, None),
    ({"ranks": 1.0, "world_size": "many"}, None),
    ({"ranks": 3.0, "world_size": "4", "ranks_scope": "in Prometheus"}, "3 of 4 ranks in Prometheus"),
    # Every rank pushed here, but two of them run on another node's GPUs.
    ({"ranks": 4.0, "world_size": "4", "token_coverage": 0.5}, "50% of the tokens from this node's GPUs"),
])
def test_rank_coverage(row: dict[str, Any], expected: str | None) -> None:
    from gpu_energy_exporter.client.fmt import rank_coverage

    assert rank_coverage(row) == expected
