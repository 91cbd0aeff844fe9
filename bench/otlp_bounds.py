"""Hostile and broken pushes against the OTLP receiver (issue 11): what they cost the exporter's memory,
its scrapes and its store lock.

``python -m bench.otlp_bounds`` runs each case in a fresh child process (so RSS is that case's alone)
through ``ExportHandler`` and ``TrainingStore`` in process, with default limits unless a case says
otherwise, and prints one Markdown table. Run it on an older checkout (``PYTHONPATH=<checkout>``) to get
the "before" figures; cases whose flags do not exist there fall back to the old constructor.

Never asserts a figure; opens no socket.
"""

from __future__ import annotations

import gc
import gzip
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import Table

CASES = ("labels", "buckets", "lock")
PB = {"Content-Type": "application/x-protobuf"}


def _rss_mb() -> float:
    return float(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def _one(case: str) -> dict[str, Any]:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

    from gpu_energy_exporter.otlp.receiver import ExportHandler
    from gpu_energy_exporter.otlp.store import TrainingStore

    def kv(k: str, v: str) -> KeyValue:
        return KeyValue(key=k, value=AnyValue(string_value=v))

    def wrap(metric: Any) -> bytes:
        return ExportMetricsServiceRequest(resource_metrics=[pb.ResourceMetrics(
            scope_metrics=[pb.ScopeMetrics(metrics=[metric])])]).SerializeToString()

    def store(**big: int) -> Any:
        try:
            return TrainingStore(**big)
        except TypeError:  # an older checkout without the byte and per-request limits
            return TrainingStore(**{k: v for k, v in big.items() if k in ("max_series", "max_series_per_run")})

    rss0 = _rss_mb()
    if case == "labels":
        s = store()
        h = ExportHandler(s, max_body_bytes=64 << 20)
        wire = 0
        for i in range(10):
            dp = pb.NumberDataPoint(attributes=[kv("run_id", f"r{i}"), kv("x", chr(97 + i) * (7 << 20))],
                                    as_double=1, time_unix_nano=time.time_ns())
            body = gzip.compress(wrap(pb.Metric(name="g", gauge=pb.Gauge(data_points=[dp]))))
            wire = len(body)
            h.handle_export({**PB, "Content-Encoding": "gzip"}, body)
        t0 = time.perf_counter()
        out = s.render(False)
        return {"case": "10 gzip pushes of one 7 MiB attribute value", "wire": f"{wire:,} B each",
                "rss": _rss_mb() - rss0, "scrape_mb": len(out) / 1e6, "scrape_s": time.perf_counter() - t0}
    if case == "buckets":
        s = store()
        h = ExportHandler(s, max_body_bytes=64 << 20)
        n = 300_000
        for i in range(11):
            dp = pb.HistogramDataPoint(attributes=[kv("run_id", f"r{i}")], explicit_bounds=[float(x) for x in range(n)],
                                       bucket_counts=[1] * (n + 1), count=n + 1, sum=1.0, time_unix_nano=time.time_ns())
            body = wrap(pb.Metric(name="h", histogram=pb.Histogram(aggregation_temporality=2, data_points=[dp])))
            h.handle_export(PB, body)
        gc.collect()
        t0 = time.perf_counter()
        out = s.render(False)
        return {"case": "11 histograms of 300,000 buckets", "wire": f"{len(body):,} B each",
                "rss": _rss_mb() - rss0, "scrape_mb": len(out) / 1e6, "scrape_s": time.perf_counter() - t0}
    n = 100_000
    s = store(max_series=10 * n, max_series_per_run=10 * n, max_new_series_per_request=10 * n,
              max_new_runs_per_request=10 * n, max_bytes=1 << 32)
    h = ExportHandler(s, max_body_bytes=64 << 20)
    dps = [pb.NumberDataPoint(attributes=[kv("run_id", "big"), kv("rank", str(i))], as_double=1,
                              time_unix_nano=time.time_ns()) for i in range(n)]
    body = wrap(pb.Metric(name="g", gauge=pb.Gauge(data_points=dps)))
    s.render(False)
    done = threading.Event()
    took: list[float] = []

    def push() -> None:
        t = time.perf_counter()
        h.handle_export(PB, body)
        took.append(time.perf_counter() - t)
        done.set()

    thread = threading.Thread(target=push)
    renders: list[float] = []
    thread.start()
    while not done.is_set():
        t = time.perf_counter()
        s.render(False)
        renders.append(time.perf_counter() - t)
    thread.join()
    return {"case": f"one push of 100,000 new series, rendered continuously meanwhile ({len(renders)} renders)",
            "wire": f"{len(body):,} B", "rss": _rss_mb() - rss0, "scrape_mb": None,
            "scrape_s": max(renders), "push_s": took[0]}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        print(json.dumps(_one(argv[1])))
        return 0
    print(f"command: `{harness.command_string('bench.otlp_bounds', argv)}`  \n{harness.machine_line()}\n")
    table = Table("Hostile pushes, in process (RSS of a fresh process per case)",
                  ["case", "request", "RSS growth MB", "scrape MB", "longest scrape s", "push s"])
    for case in CASES:
        out = subprocess.run([sys.executable, "-m", "bench.otlp_bounds", "--one", case], capture_output=True,
                             text=True, timeout=600)
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        if not lines:
            table.add(case, "failed", out.stderr.strip().splitlines()[-1:] or "", "", "", "")
            continue
        r = json.loads(lines[-1])
        table.add(r["case"], r["wire"], harness.fmt(r["rss"]),
                  harness.fmt(r["scrape_mb"]) if r["scrape_mb"] is not None else "",
                  harness.fmt(r["scrape_s"]), harness.fmt(r.get("push_s")) if r.get("push_s") else "")
    print(table.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
