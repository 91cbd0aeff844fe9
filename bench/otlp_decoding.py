"""What one OTLP request can cost the exporter's memory, and what the worst concurrency the defaults allow
can (issue 29): the exporter as its own process with default flags, one hostile or worst-shaped request at a
time over OTLP/HTTP and OTLP/gRPC (gzip'd, so the wire is never what limits them), and all of its
request slots at once (4 HTTP bodies in flight and 4 gRPC calls).

For each case a fresh exporter is started, warmed up (a helper-shaped push over both transports: gRPC loaded,
the first allocations made), its peak RSS reset (``/proc/<pid>/clear_refs``), then the request sent; the
table gives the peak growth over the RSS before (``VmHWM`` - ``VmRSS``), what stayed, the answer and the
time. The design's bounds: +64 MB for any one request the limits allow, +256 MB for the worst concurrent
case. Run it on an older checkout (``PYTHONPATH=<checkout>``) for the "before" figures.

``python -m bench.otlp_decoding [--quick] [--only CASE,...]``. Never asserts a figure; talks only to the
exporters it started on 127.0.0.1.
"""

from __future__ import annotations

import gzip
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import harness, hostile
from bench.harness import Context, Table, fmt
from bench.trainers import Trainer

TITLE = "OTLP decoding: peak memory of the worst requests the limits allow, one and all at once (issue 29)"

MiB = 1 << 20
EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
GRPC_ON = "--otlp.grpc.listen-address=127.0.0.1:0"


def _kb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def post_http(url: str, body: bytes, timeout: float = 300.0, content_type: str = "application/x-protobuf") -> str:
    """POST ``body`` gzip'd; the status."""
    req = urllib.request.Request(url, data=gzip.compress(body, 6), headers={
        "Content-Type": content_type, "Content-Encoding": "gzip"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return f"{r.status}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code}"


def post_grpc(target: str, body: bytes, timeout: float = 300.0) -> str:
    """One Export call with ``body`` as its message, gzip'd, on a channel of its own; the status code."""
    import grpc

    opts = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(target, options=opts, compression=grpc.Compression.Gzip) as ch:
        try:
            ch.unary_unary(EXPORT)(body, timeout=timeout)
        except grpc.RpcError as exc:
            return exc.code().name
    return "OK"


#: name -> (body builder, what it is). Each is the worst of its kind within the default limits, or the
#: issue's hostile request.
CASES: dict[str, tuple[Callable[[], bytes], str]] = {
    "empty_resources": (lambda: hostile.empty_resources(8 * MiB - 16),
                        "8 MiB of empty ResourceMetrics (the issue's request; 8 KB gzip'd)"),
    "attribute_flood": (lambda: hostile.attribute_flood(8 * MiB - 64), "one point with 8 MiB of empty attributes"),
    "points_one_metric": (lambda: hostile.gauge_points(16_000, 3), "16,000 points of one gauge, distinct series"),
    "points_helper_shape": (lambda: hostile.gauge_points(16_000, 3, per_metric=1),
                            "16,000 points, a metric each, distinct series"),
    "points_over": (lambda: hostile.gauge_points(40_000, 3), "40,000 points of one gauge (over the limit)"),
    "wide_points": (lambda: hostile.gauge_points(4_500, 31), "4,500 points of 31 attributes each"),
    "wide_points_over": (lambda: hostile.gauge_points(12_000, 31),
                         "12,000 points of 31 attributes each (7 MiB: over what the translation may make)"),
    "histograms": (lambda: hostile.histogram_points(1_000, 256), "1,000 histograms of 256 buckets"),
    "histograms_over": (lambda: hostile.histogram_points(2_000, 256),
                        "2,000 histograms of 256 buckets (8 MiB: over what the translation may make)"),
    "quantiles": (lambda: hostile.empty_quantiles(390_000), "390,000 empty summary quantiles"),
    "exemplars": (lambda: hostile.empty_exemplars(240_000), "240,000 empty exemplars"),
    "resources_with_attributes": (lambda: hostile.resources_with_attributes(4_000, 12),
                                  "4,000 resources of 12 attributes"),
    "json_points": (lambda: hostile.as_json(hostile.gauge_points(9_000, 3, per_metric=1)),
                    "OTLP/JSON: 9,000 points, a metric each, distinct series"),
}
#: Cases whose body is OTLP/JSON (over HTTP only).
JSON_CASES = frozenset({"json_points"})


def _warm(exp: Any) -> None:
    body, _ = Trainer("warm", 0).request()
    post_http(exp.push_url, body)
    post_grpc(exp.grpc_endpoint.split("//", 1)[1], body)


def measure(case: str, transport: str, concurrent: int = 1) -> dict[str, Any]:
    """One fresh exporter, ``concurrent`` copies of ``case`` sent at once over ``transport`` ("http", "grpc" or
    "both": ``concurrent`` over each); peak and kept RSS growth in MB."""
    from helpers import ExporterProcess

    body = CASES[case][0]()
    with ExporterProcess(["--no-collector.gpu", GRPC_ON], new_session=True) as exp:
        exp.wait_ready()
        _warm(exp)
        time.sleep(0.5)
        Path(f"/proc/{exp.pid}/clear_refs").write_text("5")  # the peak starts again from now
        before = _kb(exp.pid, "VmRSS")
        answers: list[str] = []
        senders: list[Callable[[], str]] = []
        target = exp.grpc_endpoint.split("//", 1)[1]
        content_type = "application/json" if case in JSON_CASES else "application/x-protobuf"
        if transport in ("http", "both"):
            senders += [lambda: post_http(exp.push_url, body, content_type=content_type)] * concurrent
        if transport in ("grpc", "both"):
            senders += [lambda: post_grpc(target, body)] * concurrent
        threads = [threading.Thread(target=lambda s=s: answers.append(s())) for s in senders]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        took = time.perf_counter() - t0
        peak, kept = _kb(exp.pid, "VmHWM") - before, _kb(exp.pid, "VmRSS") - before
    return {"case": case, "transport": transport, "concurrent": concurrent, "body": len(body),
            "gzip": len(gzip.compress(body, 6)), "answers": sorted(set(answers)), "peak": peak, "kept": kept,
            "seconds": took}


def run(ctx: Context, only: list[str] | None = None) -> list[Table]:
    single = Table(
        "One request at a time (a fresh exporter per row, default limits)",
        ["request", "body", "gzip'd", "over", "answer", "peak RSS growth MB", "kept MB", "s"],
        ["Peak: VmHWM after the request minus VmRSS before it (the peak reset after a warm-up push). Bound: "
         "+64 MB for any one request the limits allow."],
    )
    cases = only or list(CASES)
    for case in cases:
        for transport in ("http",) if case in JSON_CASES else ("http", "grpc"):
            r = measure(case, transport)
            single.add(CASES[case][1], f"{r['body']:,} B", f"{r['gzip']:,} B", transport, "/".join(r["answers"]),
                       fmt(r["peak"]), fmt(r["kept"]), fmt(r["seconds"]))
    together = Table(
        "All at once: 4 HTTP bodies in flight and 4 gRPC calls (what the default slots admit), the same request",
        ["request", "calls", "answers", "peak RSS growth MB", "kept MB", "s"],
        ["Bound: +256 MB for the worst concurrent case the defaults allow. The HTTP port holds 4 bodies in flight "
         "(503 beyond), the gRPC port receives 4 calls at once (others wait with a 64 KiB window); bodies over "
         "64 KiB are decoded 2 at a time across both ports."],
    )
    worst = ("empty_resources", "points_helper_shape", "wide_points", "histograms", "histograms_over", "exemplars")
    for case in ctx.pick(cases[:2], [c for c in cases if c in worst] or cases[:2]):
        r = measure(case, "both", 4)
        together.add(CASES[case][1], "4 HTTP + 4 gRPC", "/".join(r["answers"]), fmt(r["peak"]), fmt(r["kept"]),
                     fmt(r["seconds"]))
    return [single, together]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    only = None
    if "--only" in argv:
        i = argv.index("--only")
        only = argv[i + 1].split(",")
        del argv[i:i + 2]
    quick = "--quick" in argv
    print(f"command: `{harness.command_string('bench.otlp_decoding', sys.argv[1:] if argv is None else argv)}`  \n"
          f"{harness.machine_line()}\n")
    ctx = Context(quick=quick, workdir=Path("/tmp"), soak_s=0, peers=False, command="")
    for table in run(ctx, only):
        print(table.render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
