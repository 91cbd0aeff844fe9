"""Stand-in inference servers: small HTTP servers whose /metrics expose exactly what vLLM, SGLang, TGI and Triton
expose for the token and request counters (names, types, labels and the text format of each engine's
Prometheus library), driven by a scripted token trace.

For tests and benchmarks, in the spirit of ``kubernetes.testing.FakeKubelet``: you give a trace, the server
counts whole tokens and requests along it on its clock, and anything that scrapes it (Prometheus, the
exporter's inference collector) reads the same bytes as from the real engine.

    with VLLMServer(model="llama-3-8b", trace=Trace.constant(prompt=1536, output=512, requests=4)) as s:
        s.metrics_url          # http://127.0.0.1:PORT/metrics
        s.restart()            # the process restarts: every counter starts again from 0
        s.set_trace(Trace.idle())
        s.delay_s = 5.0        # answer every scrape 5 s late
        s.hang = True          # accept, read the request, never answer (until stop)
        s.hostile = Hostile.many_series(100_000)

Where each engine defines what is mimicked (the same sources ``dashboards/engines.py`` cites):
- vLLM: vllm/v1/metrics/loggers.py (PrometheusStatLogger: prometheus_client counters with labels
  model_name, engine, created for every engine core at start; request_success per finished_reason).
- SGLang: python/sglang/srt/metrics/collector.py (TokenizerMetricsCollector: prometheus_client counters
  with the label model_name, created by the first finished request; cached tokens only once some were).
- TGI: router/src/validation.rs (tgi_request_input_length, at validation) and router/src/server.rs
  (tgi_request_generated_tokens, tgi_request_success, tgi_request_count; the metrics-exporter-prometheus
  recorder: no labels, counters without `_total`, histograms of 100 buckets, each series appears with
  its first record).
- Triton: core src/metric_model_reporter.cc (nv_inference_count{model,version}); the TensorRT-LLM
  backend's inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc
  (nv_llm_input_token_len / nv_llm_output_token_len histograms, label response_metric_type, buckets
  10..1000, created when the model loads); the vLLM backend's src/utils/metrics.py (vLLM's names with
  model, version). prometheus-cpp's text format: labels sorted, a histogram's count and sum before its
  buckets.

It never imports the exporter package, never mocks anything, and listens on 127.0.0.1 only.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# ---------------------------------------------------------------------------------------------------------
# The scripted load


@dataclass(frozen=True)
class Segment:
    """``seconds`` of steady load (``math.inf``: for ever), in tokens and finished requests per second."""

    seconds: float
    prompt_per_s: float = 0.0
    output_per_s: float = 0.0
    requests_per_s: float = 0.0
    cached_per_s: float = 0.0  # prompt tokens served from the prefix cache (SGLang counts them apart)


@dataclass(frozen=True)
class Totals:
    """Whole tokens and requests counted since the server (re)started."""

    prompt: int = 0
    output: int = 0
    requests: int = 0
    cached: int = 0


class Trace:
    """A token trace: segments one after the other from the trace's start, then nothing (idle)."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = tuple(segments)

    @classmethod
    def constant(cls, prompt: float = 0.0, output: float = 0.0, requests: float = 0.0,
                 cached: float = 0.0) -> Trace:
        return cls([Segment(math.inf, prompt, output, requests, cached)])

    @classmethod
    def idle(cls) -> Trace:
        return cls([])

    def cumulative(self, elapsed: float) -> tuple[float, float, float, float]:
        """Exact (prompt, output, requests, cached) from the trace's start to ``elapsed`` seconds."""
        p = o = r = c = 0.0
        left = max(elapsed, 0.0)
        for seg in self.segments:
            dt = min(left, seg.seconds)
            p, o, r, c = p + seg.prompt_per_s * dt, o + seg.output_per_s * dt, r + seg.requests_per_s * dt, \
                c + seg.cached_per_s * dt
            left -= dt
            if left <= 0:
                break
        return p, o, r, c


@dataclass(frozen=True)
class Hostile:
    """What a broken or hostile server sends instead of (or on top of) its normal output."""

    kind: Literal["huge_label", "many_series", "garbage", "huge_body"]
    size: int

    @classmethod
    def huge_label(cls, value_bytes: int = 1 << 20) -> Hostile:
        """The model label ``value_bytes`` long (a served-model name nobody checked)."""
        return cls("huge_label", value_bytes)

    @classmethod
    def many_series(cls, count: int = 100_000) -> Hostile:
        """``count`` extra series of one counter, one per label value (a per-request id as a label)."""
        return cls("many_series", count)

    @classmethod
    def garbage(cls, size: int = 4096) -> Hostile:
        """``size`` bytes that are no exposition format at all."""
        return cls("garbage", size)

    @classmethod
    def huge_body(cls, size: int = 64 << 20) -> Hostile:
        """The normal output padded with comment lines to ``size`` bytes."""
        return cls("huge_body", size)


# ---------------------------------------------------------------------------------------------------------
# The server


class StandInServer:
    """An engine's /metrics on 127.0.0.1: ``start``/``stop`` (or ``with``), ``restart``, ``set_trace``, and the
    misbehaviours ``delay_s``, ``hang`` and ``hostile``. ``totals()`` is what it exposes now (ground truth)."""

    engine = ""

    def __init__(self, model: str = "llama-3-8b", trace: Trace | None = None, *,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.model = model
        self.delay_s = 0.0
        self.hang = False
        self.hostile: Hostile | None = None
        self.scrapes = 0
        self._clock, self._wall = clock, wall
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._port = 0
        self._trace = trace or Trace.idle()
        now = clock()
        self._trace_origin = now  # the trace's t = 0
        self._base = (0.0, 0.0, 0.0, 0.0)  # exact counts carried over from earlier traces since the (re)start
        self._count_origin = (0.0, 0.0, 0.0, 0.0)  # the trace's exact counts at the last (re)start
        self._started_wall = wall()  # the process start, as prometheus_client's `_created` says

    # -- load ------------------------------------------------------------------------------------------------

    def set_trace(self, trace: Trace) -> None:
        """Follow ``trace`` from now on; the counters carry on from where they are."""
        with self._lock:
            now = self._clock()
            self._base = self._exact(now)
            self._count_origin = (0.0, 0.0, 0.0, 0.0)
            self._trace, self._trace_origin = trace, now

    def _exact(self, now: float) -> tuple[float, float, float, float]:
        cur = self._trace.cumulative(now - self._trace_origin)
        return tuple(b + c - o for b, c, o in zip(self._base, cur, self._count_origin, strict=True))  # type: ignore[return-value]

    def totals(self) -> Totals:
        """The whole tokens and requests the server counted since it (re)started."""
        with self._lock:
            p, o, r, c = self._exact(self._clock())
        return Totals(math.floor(p + 1e-9), math.floor(o + 1e-9), math.floor(r + 1e-9), math.floor(c + 1e-9))

    def restart(self) -> None:
        """The server process restarts: the port closes and reopens, every counter starts again from 0, and
        the load goes on along the trace."""
        running = self._server is not None
        if running:
            self.stop()
        with self._lock:
            now = self._clock()
            self._count_origin = self._trace.cumulative(now - self._trace_origin)
            self._base = (0.0, 0.0, 0.0, 0.0)
            self._started_wall = self._wall()
        if running:
            self.start()

    # -- HTTP ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    @property
    def target(self) -> str:
        """``host:port``, as a scrape config names it."""
        return f"127.0.0.1:{self._port}"

    def start(self) -> StandInServer:
        """Listen (on the port it had before, after a stop or restart)."""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                owner._answer(self)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
                pass

        self._stopping.clear()
        server = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        server.daemon_threads = True
        self._port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=f"standin-{self.engine}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening; a hung or delayed answer is abandoned."""
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def __enter__(self) -> StandInServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _answer(self, request: BaseHTTPRequestHandler) -> None:
        if request.path.split("?")[0] != "/metrics":
            request.send_error(404)
            return
        with self._lock:
            self.scrapes += 1
            hang, delay = self.hang, self.delay_s
        if hang:
            self._stopping.wait()
            return
        if delay and self._stopping.wait(delay):
            return
        body = self.body()
        try:
            request.send_response(200)
            request.send_header("Content-Type", self.content_type)
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
        except OSError:  # the scraper gave up (its timeout) and closed the connection
            pass

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def body(self) -> bytes:
        """What /metrics answers now."""
        hostile = self.hostile
        if hostile is not None and hostile.kind == "garbage":
            # (An error page, with bytes no text format allows. Not a NUL first: Prometheus's text parser reads a
            # NUL as the end of the input, so such a body scrapes as empty, not as an error.)
            pattern = b"<html><body>502 Bad Gateway \xff\xfe\x00 {{ not exposition }}</body></html>\n"
            return (pattern * (hostile.size // len(pattern) + 1))[: hostile.size]
        model = "m" * hostile.size if hostile is not None and hostile.kind == "huge_label" else self.model
        text = self.exposition(self.totals(), model)
        if model != self.model and model not in text:  # an engine without a model label (TGI)
            text += self.extra_series(model)
        if hostile is not None and hostile.kind == "many_series":
            text += "".join(self.extra_series(f"r{i}") for i in range(hostile.size))
        data = text.encode()
        if hostile is not None and hostile.kind == "huge_body" and len(data) < hostile.size:
            line = b"# " + b"x" * 1022 + b"\n"
            data += line * ((hostile.size - len(data)) // len(line) + 1)
        return data

    # -- what each engine exposes ----------------------------------------------------------------------------

    def exposition(self, t: Totals, model: str) -> str:
        raise NotImplementedError

    def extra_series(self, label_value: str) -> str:
        """One sample line of an engine counter with a label value the engine does not send (a hostile
        server's unbounded label)."""
        raise NotImplementedError


def _per_request(total: int, requests: int) -> float:
    return total / requests if requests else 0.0


def _buckets(bounds: Sequence[float], requests: int, mean: float) -> list[tuple[float, int]]:
    """Cumulative buckets with every request observed at ``mean`` (enough for a histogram whose `_sum` is
    read, and consistent: +Inf equals the count)."""
    return [(b, requests if mean <= b else 0) for b in bounds] + [(math.inf, requests)]


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


class _ClientPython(StandInServer):
    """An engine that exposes its metrics with prometheus_client, as vLLM and SGLang do."""

    def families(self, t: Totals, model: str) -> list[Metric]:
        raise NotImplementedError

    def exposition(self, t: Totals, model: str) -> str:
        families = self.families(t, model)

        class _Collector:
            def collect(self) -> list[Metric]:
                return families

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector())  # type: ignore[arg-type]
        return generate_latest(registry).decode()


class VLLMServer(_ClientPython):
    """vLLM (V1 engine): every series exists, at 0, from start; one engine core (``engine="0"``). Names, types and
    labels from vllm/v1/metrics/loggers.py (PrometheusStatLogger)."""

    engine = "vllm"
    #: build_1_2_5_buckets(max_model_len=4096)
    LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)

    def families(self, t: Totals, model: str) -> list[Metric]:
        labels, values, created = ["model_name", "engine"], [model, "0"], self._started_wall
        out: list[Metric] = []
        running = GaugeMetricFamily("vllm:num_requests_running", "Number of requests in model execution batches.",
                                    labels=labels)
        running.add_metric(values, 0.0)
        out.append(running)
        for name, doc, value in (("vllm:prompt_tokens", "Number of prefill tokens processed.", t.prompt),
                                 ("vllm:generation_tokens", "Number of generation tokens processed.", t.output)):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value), created=created)
            out.append(c)
        success = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                      labels=[*labels, "finished_reason"])
        length = t.requests // 4
        for reason, n in (("stop", t.requests - length), ("length", length), ("abort", 0)):
            success.add_metric([*values, reason], float(n), created=created)
        out.append(success)
        for name, doc, total in (("vllm:request_prompt_tokens", "Number of prefill tokens processed.", t.prompt),
                                 ("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                  t.output)):
            h = HistogramMetricFamily(name, doc, labels=labels)
            h.add_metric(values, [(_le(b), float(n)) for b, n in _buckets(
                self.LENGTH_BUCKETS, t.requests, _per_request(total, t.requests))], float(total))
            out.append(h)
        return out

    def extra_series(self, label_value: str) -> str:
        labels = f'engine="0",finished_reason="{label_value}",model_name="{self.model}"'
        return f"vllm:request_success_total{{{labels}}} 1.0\n"


class SGLangServer(_ClientPython):
    """SGLang (``--enable-metrics``): the tokenizer's counters appear with the first finished request. Names, types
    and labels from python/sglang/srt/metrics/collector.py (TokenizerMetricsCollector)."""

    engine = "sglang"

    def families(self, t: Totals, model: str) -> list[Metric]:
        if t.requests == 0:
            return []
        out: list[Metric] = []
        for name, doc, value in (
                ("sglang:prompt_tokens_total", "Number of prefill tokens processed.", t.prompt),
                ("sglang:generation_tokens_total", "Number of generation tokens processed.", t.output),
                ("sglang:cached_tokens_total", "Number of cached prompt tokens.", t.cached),
                ("sglang:num_requests_total", "Number of requests processed.", t.requests)):
            if name == "sglang:cached_tokens_total" and value == 0:
                continue  # incremented only when a request had cached tokens
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], float(value), created=self._started_wall)
            out.append(c)
        return out

    def extra_series(self, label_value: str) -> str:
        return f'sglang:num_requests_total{{model_name="{label_value}"}} 1.0\n'


class TGIServer(StandInServer):
    """Text Generation Inference: no labels at all (one model per server); counters without ``_total``. Names
    from router/src/validation.rs (tgi_request_input_length) and router/src/server.rs (the others)."""

    engine = "tgi"
    content_type = "text/plain; version=0.0.4"
    MAX_INPUT_TOKENS = 4095
    MAX_TOTAL_TOKENS = 4096

    def exposition(self, t: Totals, model: str) -> str:
        out: list[str] = []
        if t.requests == 0:
            return ""
        # tgi_request_count: every request that arrived (counted here as the finished ones).
        for name, doc, value in (("tgi_request_count", "", t.requests),
                                 ("tgi_request_success", "Number of successful requests", t.requests)):
            if doc:
                out.append(f"# HELP {name} {doc}\n")
            out.append(f"# TYPE {name} counter\n{name} {value}\n\n")
        for name, doc, total, top in (
                ("tgi_request_input_length", "Input token length per request", t.prompt, self.MAX_INPUT_TOKENS),
                ("tgi_request_generated_tokens", "Generated tokens per request", t.output, self.MAX_TOTAL_TOKENS)):
            bounds = [top / 100.0 * (x + 1) for x in range(100)]
            out.append(f"# HELP {name} {doc}\n# TYPE {name} histogram\n")
            for bound, n in _buckets(bounds, t.requests, _per_request(total, t.requests)):
                le = "+Inf" if math.isinf(bound) else repr(bound)
                out.append(f'{name}_bucket{{le="{le}"}} {n}\n')
            out.append(f"{name}_sum {total}\n{name}_count {t.requests}\n\n")
        return "".join(out)

    def extra_series(self, label_value: str) -> str:
        return f'tgi_request_success{{id="{label_value}"}} 1\n'


class TritonServer(StandInServer):
    """Triton Inference Server with the TensorRT-LLM backend (``backend="tensorrtllm"``) or the vLLM backend
    (``backend="vllm"``): series created when the model loads, at 0; version "1". Names from Triton core's
    src/metric_model_reporter.cc (nv_inference_count), the TensorRT-LLM backend's
    inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc (nv_llm_*_token_len) and the
    vLLM backend's src/utils/metrics.py."""

    engine = "triton"
    TOKEN_BUCKETS = (10.0, 50.0, 100.0, 500.0, 1000.0)

    def __init__(self, model: str = "llama-3-8b", trace: Trace | None = None, *,
                 backend: Literal["tensorrtllm", "vllm"] = "tensorrtllm",
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        super().__init__(model, trace, clock=clock, wall=wall)
        self.backend = backend

    def exposition(self, t: Totals, model: str) -> str:
        lab = f'model="{model}",version="1"'
        out = ["# HELP nv_inference_count Number of inferences performed (does not include cached requests)\n",
               "# TYPE nv_inference_count counter\n", f"nv_inference_count{{{lab}}} {t.requests}\n"]
        if self.backend == "vllm":
            for name, doc, value in (("vllm:prompt_tokens_total", "Number of prefill tokens processed.", t.prompt),
                                     ("vllm:generation_tokens_total", "Number of generation tokens processed.",
                                      t.output)):
                out.append(f"# HELP {name} {doc}\n# TYPE {name} counter\n{name}{{{lab}}} {value}\n")
            return "".join(out)
        for name, kind, total in (("nv_llm_output_token_len", "total_output_tokens", t.output),
                                  ("nv_llm_input_token_len", "total_input_tokens", t.prompt)):
            hl = f'model="{model}",response_metric_type="{kind}",version="1"'
            out.append(f"# HELP {name} TRT LLM response metrics\n# TYPE {name} histogram\n")
            out.append(f"{name}_count{{{hl}}} {t.requests}\n{name}_sum{{{hl}}} {total}\n")
            for bound, n in _buckets(self.TOKEN_BUCKETS, t.requests, _per_request(total, t.requests)):
                le = "+Inf" if math.isinf(bound) else f"{bound:g}"
                out.append(f'{name}_bucket{{{hl},le="{le}"}} {n}\n')
        return "".join(out)

    def extra_series(self, label_value: str) -> str:
        return f'nv_inference_count{{model="{label_value}",version="1"}} 1\n'


#: The stand-in class of each engine, by the rules' `server` label.
SERVERS: dict[str, type[StandInServer]] = {
    cls.engine: cls for cls in (VLLMServer, SGLangServer, TGIServer, TritonServer)}
