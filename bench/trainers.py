"""OTLP requests shaped like the training helper's (gpu_energy_exporter/training/run.py), for the benchmarks
that push: one ``Trainer`` per rank building protobuf bodies of cumulative totals, ``trainers_for`` enough
ranks to hold N series, and ``push`` over a keep-alive connection.

Builds requests and sends them; never starts a process and never asserts anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import fakenvml

from bench.harness import HTTPClient

#: Series one helper rank pushes: 4 counters, 7 gauges, the run's GPU info and the step-duration histogram.
SERIES_PER_RANK = 13


class Trainer:
    """One rank of a training run, pushing cumulative totals as the helper does (protobuf bodies)."""

    def __init__(self, run_id: str, rank: int, gpu_uuid: str = "GPU-bench", n_series: int = SERIES_PER_RANK,
                 start_ns: int | None = None) -> None:
        from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

        self.run_id, self.rank, self.gpu_uuid = run_id, rank, gpu_uuid
        self.n_series = max(1, min(n_series, SERIES_PER_RANK))
        self.start_ns = start_ns if start_ns is not None else time.time_ns()
        self.step = 0
        self._kv = KeyValue
        self._av = AnyValue
        self._attrs = [KeyValue(key="run_id", value=AnyValue(string_value=run_id)),
                       KeyValue(key="rank", value=AnyValue(int_value=rank)),
                       KeyValue(key="gpu_uuid", value=AnyValue(string_value=gpu_uuid))]

    def request(self, steps: int = 10, now_ns: int | None = None) -> tuple[bytes, int]:
        """Advance ``steps`` training steps and return (body, data points) of one export."""
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
        from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

        kv, av = self._kv, self._av
        self.step += steps
        s = self.step
        t = now_ns if now_ns is not None else time.time_ns()
        req = ExportMetricsServiceRequest()
        rm = req.resource_metrics.add()
        rm.resource.attributes.extend([
            kv(key="service.name", value=av(string_value="gpu-energy-training")),
            kv(key="service.instance.id", value=av(string_value=f"{self.run_id}/{self.rank}")),
        ])
        sm = rm.scope_metrics.add()
        sm.scope.name = "gpu_energy_exporter.training"
        made = 0

        def counter(name: str, unit: str, value: float) -> None:
            m = sm.metrics.add(name=name, unit=unit)
            m.sum.is_monotonic = True
            m.sum.aggregation_temporality = pb.AGGREGATION_TEMPORALITY_CUMULATIVE
            dp = m.sum.data_points.add(start_time_unix_nano=self.start_ns, time_unix_nano=t, as_double=value)
            dp.attributes.extend(self._attrs)

        def gauge(name: str, value: float, extra: Sequence[tuple[str, str]] = ()) -> None:
            m = sm.metrics.add(name=name)
            dp = m.gauge.data_points.add(time_unix_nano=t, as_double=value)
            dp.attributes.extend(self._attrs)
            dp.attributes.extend(kv(key=k, value=av(string_value=v)) for k, v in extra)

        builders: list[Callable[[], None]] = [
            lambda: counter("training.tokens", "{token}", 4096.0 * s),
            lambda: counter("training.samples", "{sample}", 8.0 * s),
            lambda: counter("training.steps", "{step}", float(s)),
            lambda: counter("training.flops", "{flop}", 3.1e14 * s),
            lambda: gauge("training.loss", 2.0 + 1.0 / (1 + s)),
            lambda: gauge("training.learning_rate", 3e-4),
            lambda: gauge("training.epoch", s / 1000.0),
            lambda: gauge("training.validation.loss", 2.1 + 1.0 / (1 + s)),
            lambda: gauge("training.run.total_steps", 10000.0),
            lambda: gauge("training.run.finished", 0.0),
            lambda: gauge("training.run.info", 1.0, (("model", "llama-3-8b"), ("backend", "unsloth"),
                                                     ("batch_size", "8"), ("seq_len", "2048"))),
            lambda: gauge("training.run.gpu.info", 1.0),
            self._histogram_builder(sm, t, s),
        ]
        for build in builders[: self.n_series]:
            build()
            made += 1
        return req.SerializeToString(), made

    def _histogram_builder(self, sm: Any, t: int, s: int) -> Callable[[], None]:
        from opentelemetry.proto.metrics.v1 import metrics_pb2 as pb

        def build() -> None:
            bounds = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0,
                      60.0, 120.0, 300.0]
            counts = [0] * (len(bounds) + 1)
            counts[7] = s  # every step took 0.1-0.25 s
            m = sm.metrics.add(name="training.step.duration", unit="s")
            m.histogram.aggregation_temporality = pb.AGGREGATION_TEMPORALITY_CUMULATIVE
            dp = m.histogram.data_points.add(start_time_unix_nano=self.start_ns, time_unix_nano=t, count=s,
                                             sum=0.17 * s, bucket_counts=counts, explicit_bounds=bounds)
            dp.attributes.extend(self._attrs)

        return build


def trainers_for(n_series: int, prefix: str = "run", ranks_per_run: int = 8) -> list[Trainer]:
    """Enough helper-like ranks to hold ``n_series`` training series (13 per rank, 8 ranks per run)."""
    out: list[Trainer] = []
    left = n_series
    i = 0
    while left > 0:
        n = min(left, SERIES_PER_RANK)
        out.append(Trainer(f"{prefix}-{i // ranks_per_run}", i % ranks_per_run,
                           gpu_uuid=fakenvml.gpu_uuid("NVIDIA H100 80GB HBM3", i % ranks_per_run), n_series=n))
        left -= n
        i += 1
    return out


PROTOBUF_HEADERS = {"Content-Type": "application/x-protobuf"}


def push(client: HTTPClient, trainer: Trainer, steps: int = 10) -> tuple[int, int, float]:
    """Push one export of ``trainer``; (status, points, seconds)."""
    body, points = trainer.request(steps)
    status, _, elapsed = client.request("POST", None, body, PROTOBUF_HEADERS)
    return status, points, elapsed
