"""OTLP receiver: data points per second on one core, and memory under series churn.

Three measurements:

- In process, one thread: ``ExportHandler.handle_export`` (decode, translate, store) on protobuf bodies
  shaped like the training helper's exports, for 1, 10 and 80 ranks per request (one rank's own export;
  a Collector batching ranks), plus gzip and OTLP JSON variants. CPU time of the thread
  (``time.thread_time``) is the denominator, so the figure is "per core" whatever else the machine does.
- Over HTTP and gRPC: the exporter as its own process, this process pushing on one keep-alive connection
  (one gRPC channel); points per second of the exporter's CPU time (its request thread runs under the GIL:
  one core).
- Memory under churn: a store driven by a simulated clock through hours of runs starting and ending
  (series expire through the TTL), and a runaway trainer inventing a new series with every point (the
  series limit rejects them). Memory is what ``tracemalloc`` sees allocated by the process.

Never asserts a figure; only talks to the exporter it started on 127.0.0.1.
"""

from __future__ import annotations

import gzip
import logging
import sys
import time
import tracemalloc

from helpers import ExporterProcess

from bench import harness
from bench.harness import Context, CPUWindow, HTTPClient, Table, exporter, fmt
from bench.trainers import PROTOBUF_HEADERS, Trainer

TITLE = "OTLP receiver throughput and memory (design target: >= 20,000 data points/s on one core, bounded memory)"

RANKS = 80  # 1,040 series: about the 1,000 of the latency benchmark


def _rounds(n_rounds: int, prefix: str) -> list[list[tuple[bytes, int]]]:
    """``n_rounds`` successive exports of every rank: rounds[k][rank] = (body, points)."""
    trainers = [Trainer(f"{prefix}-{i // 8}", i % 8) for i in range(RANKS)]
    return [[t.request() for t in trainers] for _ in range(n_rounds)]


def _batched(rounds: list[list[tuple[bytes, int]]], per_request: int) -> list[tuple[bytes, int]]:
    # Concatenated protobuf messages parse as one message with the repeated fields appended: exactly the
    # request a Collector would send with those ranks' resource metrics batched.
    out = []
    for r in rounds:
        for i in range(0, len(r), per_request):
            part = r[i:i + per_request]
            out.append((b"".join(b for b, _ in part), sum(n for _, n in part)))
    return out


def _to_json(body: bytes) -> bytes:
    from google.protobuf import json_format
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    req = ExportMetricsServiceRequest()
    req.ParseFromString(body)
    return json_format.MessageToJson(req, indent=None).encode()


def _in_process(requests: list[tuple[bytes, int]], headers: dict[str, str],
                seconds: float, ledger: bool = False) -> tuple[float, float, float]:
    """(points per CPU second, requests per CPU second, µs per point); fresh store per pass (and, with
    ``ledger``, a fresh run ledger listening to it as in the exporter)."""
    from gpu_energy_exporter.ledger import RunLedger
    from gpu_energy_exporter.otlp.receiver import ExportHandler
    from gpu_energy_exporter.otlp.store import TrainingStore

    cpu = 0.0
    points = 0
    reqs = 0
    while cpu < seconds:
        store = TrainingStore(max_series=10**6, max_series_per_run=10**6)
        if ledger:
            store.add_batch_listener(RunLedger(None).on_points)
        handler = ExportHandler(store)
        c0 = time.thread_time()
        for body, n in requests:
            status, _, _ = handler.handle_export(headers, body)
            if status != 200:
                raise RuntimeError(f"export answered {status}")
            points += n
            reqs += 1
        cpu += time.thread_time() - c0
    return points / cpu, reqs / cpu, cpu / points * 1e6


def run(ctx: Context) -> list[Table]:
    seconds = ctx.pick(0.15, 3.0)
    n_rounds = ctx.pick(3, 20)
    rounds = _rounds(n_rounds, "tp")
    pb = dict(PROTOBUF_HEADERS)
    inproc = Table(
        "In process, one thread: decode + translate + store (1,040 series of 80 helper-like ranks)",
        ["request", "points/request", "points per CPU-second", "requests per CPU-second", "µs per point"],
        [f"Each pass sends {n_rounds} successive exports of every rank into a fresh store (so 1 in "
         f"{n_rounds} points creates its series); at least {seconds:g} s of thread CPU time per row."],
    )
    for per, label in ((1, "protobuf, 1 rank (the helper's own export)"), (10, "protobuf, 10 ranks"),
                       (80, "protobuf, 80 ranks (a Collector's batch)")):
        reqs = _batched(rounds, per)
        pps, rps, us = _in_process(reqs, pb, seconds)
        inproc.add(label, reqs[0][1], fmt(pps), fmt(rps), fmt(us))
        if per == 1:
            pps, rps, us = _in_process(reqs, pb, seconds, ledger=True)
            inproc.add("protobuf, 1 rank, the run ledger listening (as in the exporter)", reqs[0][1], fmt(pps),
                       fmt(rps), fmt(us))
    gz = [(gzip.compress(b, 6), n) for b, n in _batched(rounds, 10)]
    pps, rps, us = _in_process(gz, {**pb, "Content-Encoding": "gzip"}, seconds)
    inproc.add("protobuf + gzip, 10 ranks", gz[0][1], fmt(pps), fmt(rps), fmt(us))
    js = [(_to_json(b), n) for b, n in _batched(rounds, 1)]
    pps, rps, us = _in_process(js, {"Content-Type": "application/json"}, seconds)
    inproc.add("OTLP JSON, 1 rank", js[0][1], fmt(pps), fmt(rps), fmt(us))
    tables = [inproc, _over_http(ctx), *_churn(ctx)]
    if ctx.profile is not None:
        tables.append(_profile(ctx))
    return tables


def _over_http(ctx: Context) -> Table:
    duration = ctx.pick(0.5, 8.0)
    n_rounds = ctx.pick(6, 120)
    table = Table(
        "Over HTTP and gRPC: the exporter process receiving on one keep-alive connection (one gRPC channel)",
        ["request", "points pushed", "wall s", "points/s (wall)", "exporter CPU %", "points per exporter CPU-second"],
        ["The client runs in another process and pre-builds its bodies; the exporter runs its normal sampler "
         "(no GPUs: NVML unavailable) beside the receiver. Issue 15's target: >= 50,000 points per exporter "
         "CPU-second for protobuf, one rank's export per request (the first row). gRPC rows: unary "
         "MetricsService/Export calls one after another on one channel (the SDK's gRPC exporter's pattern)."],
    )
    js = {"Content-Type": "application/json"}
    cases: list[tuple[str, int, dict[str, str], bool]] = [
        ("protobuf, 1 rank per request (the helper's own export)", 1, PROTOBUF_HEADERS, False),
        ("OTLP JSON, 1 rank per request", 1, js, True),
        ("protobuf, 10 ranks per request", 10, PROTOBUF_HEADERS, False),
    ]
    with exporter(ctx, ["--otlp.grpc.listen-address=127.0.0.1:0"]) as exp:
        for label, per, headers, as_json in cases:
            bodies = _batched(_rounds(n_rounds, f"http{per}{'j' if as_json else ''}"), per)
            if as_json:
                bodies = [(_to_json(b), n) for b, n in bodies]
            points, wall, cpu = _push_all(exp, bodies, headers, duration)
            table.add(label, points, fmt(wall), fmt(points / wall), fmt(100.0 * cpu / wall),
                      fmt(points / cpu if cpu else float("nan")))
        for label, per, gz in (("gRPC, protobuf, 1 rank per call", 1, False),
                               ("gRPC, protobuf + gzip, 10 ranks per call", 10, True)):
            bodies = _batched(_rounds(n_rounds, f"grpc{per}"), per)
            points, wall, cpu = _push_grpc(exp, bodies, duration, gz)
            table.add(label, points, fmt(wall), fmt(points / wall), fmt(100.0 * cpu / wall),
                      fmt(points / cpu if cpu else float("nan")))
    return table


def _push_grpc(exp: ExporterProcess, bodies: list[tuple[bytes, int]], duration: float,
               gz: bool) -> tuple[int, float, float]:
    """``_push_all`` over OTLP/gRPC: unary Export calls on one channel, message compression when ``gz``."""
    import grpc

    from gpu_energy_exporter.otlp.grpcreceiver import METHOD, SERVICE

    compression = grpc.Compression.Gzip if gz else None
    with grpc.insecure_channel(exp.grpc_endpoint.split("//", 1)[1]) as channel:
        export = channel.unary_unary(f"/{SERVICE}/{METHOD}")
        export(bodies[0][0], timeout=30, compression=compression)
        points = 0
        t_end = time.monotonic() + duration
        with CPUWindow(exp.pid) as w:
            for body, n in bodies[1:]:
                export(body, timeout=30, compression=compression)
                points += n
                if time.monotonic() > t_end:
                    break
    return points, w.wall_s, w.cpu_s


def _push_all(exp: ExporterProcess, bodies: list[tuple[bytes, int]], headers: dict[str, str],
              duration: float) -> tuple[int, float, float]:
    """Push ``bodies`` in order on one keep-alive connection for at most ``duration`` s: (points, wall s,
    exporter CPU s); the first body is sent before the window opens."""
    client = HTTPClient(exp.push_url)
    client.request("POST", None, bodies[0][0], headers)
    points = 0
    t_end = time.monotonic() + duration
    with CPUWindow(exp.pid) as w:
        for body, n in bodies[1:]:
            status, _, _ = client.request("POST", None, body, headers)
            if status != 200:
                raise RuntimeError(f"push answered {status}")
            points += n
            if time.monotonic() > t_end:
                break
    client.close()
    return points, w.wall_s, w.cpu_s


def _profile(ctx: Context) -> Table:
    """The exporter under cProfile (every thread) receiving one rank's protobuf export per request; prints
    the top functions of the OTLP connection thread: receive -> decode -> translate -> store."""
    from bench import profiled

    assert ctx.profile is not None
    outdir = ctx.profile / "otlp"
    duration = ctx.pick(1.0, 10.0)
    bodies = _batched(_rounds(ctx.pick(6, 60), "prof"), 1)
    with exporter(ctx, profile=outdir) as exp:
        with harness.FlameGraph(exp.pid, outdir / "flame.svg") as flame:
            points, _, _ = _push_all(exp, bodies, PROTOBUF_HEADERS, duration)
        time.sleep(0.5)  # the server threads end and hand in their profiles
    # http.server.HTTPServer: small pushes are handled on the selector thread (otlp-http), larger ones on a worker
    for prof in (outdir / "otlp-http.prof", outdir / "otlp-worker.prof"):
        print(f"\n#### Profile of the OTLP server's {prof.stem.split('-')[-1]} threads, protobuf, 1 rank per "
              f"request: top 15 by cumulative time ({prof})\n")
        print("```\n" + (profiled.top(prof, 15) if prof.exists() else "missing: " + str(prof)) + "```\n")
    table = Table("--profile: where the receiver's time goes", ["output", "path"],
                  [f"{points:,} points pushed under cProfile in {duration:g} s (timings under the profiler mean "
                   "nothing; the split does). cProfile's clock is wall time: a function blocked on the GIL "
                   "or a socket counts as busy. `python -m pstats FILE` to explore."])
    table.add("cProfile, per thread group", str(outdir) + "/*.prof")
    table.add("flame graph (py-spy)", str(outdir / "flame.svg") if not flame.error else flame.error)
    return table


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _churn(ctx: Context) -> list[Table]:
    from gpu_energy_exporter.otlp.receiver import ExportHandler
    from gpu_energy_exporter.otlp.store import TrainingStore

    minutes = ctx.pick(12, 90)
    clock = _Clock()
    store = TrainingStore(series_ttl=600.0, clock=clock)
    handler = ExportHandler(store)
    pb = PROTOBUF_HEADERS
    churn = Table(
        f"Memory under churn: {minutes} simulated minutes of runs starting and ending (TTL 10 min)",
        ["simulated minute", "series held", "series expired (total)", "traced MB"],
        ["Every simulated minute 2 runs of 8 ranks (13 series each) start; a run lasts 5 min and each of "
         "its ranks exports once a minute; --otlp.series-ttl=10m (the default) drops finished runs' series. "
         "tracemalloc's current size of the whole process (store included)."],
    )
    tracemalloc.start()
    try:
        runs: list[tuple[int, list[Trainer]]] = []
        base = tracemalloc.get_traced_memory()[0]
        for minute in range(minutes + 1):
            clock.now += 60.0
            runs = [(start, ts) for start, ts in runs if minute - start < 5]
            for j in range(2):
                runs.append((minute, [Trainer(f"m{minute}-{j}", r, start_ns=int(clock.now * 1e9))
                                      for r in range(8)]))
            for _, ranks in runs:
                for t in ranks:
                    body, _ = t.request(now_ns=int(clock.now * 1e9))
                    handler.handle_export(pb, body)
            store.expire()
            if minute % max(1, minutes // 10) == 0:
                mem = (tracemalloc.get_traced_memory()[0] - base) / 1e6
                churn.add(minute, store.series_count(), _expired(store), fmt(mem))
        del runs
        runaway = _runaway(ctx)
    finally:
        tracemalloc.stop()
    return [churn, runaway]


def _expired(store: object) -> int:
    for fam in store.collect():  # type: ignore[attr-defined]
        if fam.name == "gpuenergy_otlp_series_expired":
            return int(fam.samples[0].value)
    return -1


def _runaway(ctx: Context) -> Table:
    """One trainer inventing a series per point, far past --otlp.max-series (default 20,000)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

    from gpu_energy_exporter.otlp.receiver import ExportHandler
    from gpu_energy_exporter.otlp.store import TrainingStore

    max_series = ctx.pick(2000, 20000)
    total = max_series * 2
    table = Table(
        f"A runaway trainer: one new series per point, {total:,} points, --otlp.max-series={max_series:,}",
        ["points sent", "series held", "points rejected", "traced MB"],
        ["Points carry a fresh `step` label each (a classic cardinality bug); the store keeps at most "
         "--otlp.max-series series and rejects the rest with reason series_limit / run_series_limit."],
    )
    base = tracemalloc.get_traced_memory()[0]
    # The store warns once a minute about rejected points; this run rejects on purpose.
    logging.getLogger("gpu_energy_exporter.otlp").setLevel(logging.ERROR)
    store = TrainingStore(max_series=max_series, max_series_per_run=max_series)
    handler = ExportHandler(store)
    now = time.time_ns()
    sent = rejected = 0
    per_request = 500
    for start in range(0, total, per_request):
        req = ExportMetricsServiceRequest()
        # Not a training-contract name: those refuse a label outside the contract before the store
        # (contract_violation, otlp.reserved), and the series limit would never be reached.
        m = req.resource_metrics.add().scope_metrics.add().metrics.add(name="app.queue_depth")
        for i in range(start, start + per_request):
            dp = m.gauge.data_points.add(time_unix_nano=now, as_double=1.0)
            dp.attributes.extend([KeyValue(key="run_id", value=AnyValue(string_value="runaway")),
                                  KeyValue(key="step", value=AnyValue(int_value=i))])
        status, _, _ = handler.handle_export(PROTOBUF_HEADERS, req.SerializeToString())
        sent += per_request
        if sent in (total // 4, total // 2, total):
            by_reason = {s.labels.get("reason", ""): int(s.value) for fam in store.collect()
                         if fam.name == "gpuenergy_otlp_points_rejected" for s in fam.samples}
            other = {r: n for r, n in by_reason.items() if n and r not in ("series_limit", "run_series_limit")}
            if other:  # the table would measure something else than the limit
                raise RuntimeError(f"runaway points rejected for other reasons: {other}")
            rejected = sum(by_reason.values())
            table.add(sent, store.series_count(), rejected,
                      fmt((tracemalloc.get_traced_memory()[0] - base) / 1e6))
    return table


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.otlp_throughput"))
