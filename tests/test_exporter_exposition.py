"""The exporter's /metrics sources cached by version serve what a fresh encode gives, whatever moved
between two scrapes (a connection opened or closed, a push, a series past its TTL): the version of each
covers everything its bytes show.

A real exporter on the simulated backend, on ephemeral ports; scrapes and pushes over HTTP.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest
from helpers import wait_until
from prometheus_client.core import Metric

from gpu_energy_exporter.daemon.config import Config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend
from gpu_energy_exporter.engine.exposition import CachedSource, encode


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    config = Config(web_listen_address=("127.0.0.1", 0), otlp_listen_address=("127.0.0.1", 0),
                    otlp_grpc_listen_address=None,  # the suite never binds the default 4317
                    collectors=frozenset({"gpu"}), otlp_series_ttl=1.0)
    exp = Exporter(config, backend_factory=lambda: SimulatedBackend(2))
    exp.start()
    try:
        yield exp
    finally:
        exp.stop()


def _scrape(exp: Exporter) -> str:
    assert exp.web is not None
    with urllib.request.urlopen(exp.web.url + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _push(exp: Exporter, run_id: str, tokens: int) -> None:
    now_ns = str(time.time_ns())
    doc = {"resourceMetrics": [{"scopeMetrics": [{"metrics": [
        {"name": "training.tokens", "sum": {"aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [{
            "attributes": [{"key": "run_id", "value": {"stringValue": run_id}}],
            "startTimeUnixNano": now_ns, "timeUnixNano": now_ns, "asInt": str(tokens)}]}}]}]}]}
    host, port = exp.otlp.server_address
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/metrics", data=json.dumps(doc).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200


def _check_cached_sources(exp: Exporter) -> int:
    checked = 0
    for source in exp.exposition.sources:
        if source.version is None:
            continue
        for om in (False, True):
            assert source.render(om) == encode(source.collect(), om), (source.collect, om)
            checked += 1
    return checked


def test_cached_sources_serve_a_fresh_encode_after_each_change(exporter: Exporter) -> None:
    wait_until(lambda: exporter.sampler.snapshot is not None, what="the first sample")
    assert _check_cached_sources(exporter) >= 8  # build info, snapshot, training store, HTTP self-metrics
    _scrape(exporter)  # a connection opened, served and closed
    _check_cached_sources(exporter)
    _push(exporter, "run-a", 100)
    _check_cached_sources(exporter)
    assert exporter.web is not None
    held = socket.create_connection(("127.0.0.1", exporter.web.server_address[1]))
    try:
        wait_until(lambda: exporter.web is not None and exporter.web.open_connections() >= 1,
                   what="the held connection accepted")
        _check_cached_sources(exporter)
        # the held connection and the scrape's own
        assert 'gpuenergy_http_open_connections{server="gpu-energy-exporter"} 2.0' in _scrape(exporter)
    finally:
        held.close()
    wait_until(lambda: exporter.web is not None and exporter.web.open_connections() == 0,
               what="the held connection closed")
    _check_cached_sources(exporter)


def test_series_past_their_ttl_leave_cached_scrapes(exporter: Exporter) -> None:
    _push(exporter, "run-ttl", 100)
    assert 'training_tokens_total{run_id="run-ttl"}' in _scrape(exporter)
    # Nothing pushed since: every scrape is a cache hit, and expiry still takes the series out.
    wait_until(lambda: 'training_tokens_total{run_id="run-ttl"}' not in _scrape(exporter), timeout=5.0,
               what="the series to expire")


def test_plain_scrapes_are_served_on_the_selector_thread_gzip_and_filters_on_a_worker(exporter: Exporter) -> None:
    threads: list[str] = []

    def spy() -> list[Metric]:
        threads.append(threading.current_thread().name)
        return []

    exporter.exposition.sources.append(CachedSource(spy))
    assert exporter.web is not None
    url = exporter.web.url + "/metrics"
    for target, headers in ((url, {}), (url, {"Accept-Encoding": "gzip"}),
                            (url + "?name[]=gpuenergy_build_info", {})):
        with urllib.request.urlopen(urllib.request.Request(target, headers=headers), timeout=10) as resp:
            assert resp.status == 200
    assert [name.rsplit("-", 1)[-1] if "worker" not in name else "worker" for name in threads] == \
        ["http", "worker", "worker"], threads
