"""The inference servers' own series that ``dashboards/rules/inference.yaml`` reads: each engine's metric names,
types and labels, as the engine's source defines them.

These names are the engines', not ours: every entry cites the file of the engine's repository that defines
it. The stand-in servers of the tests (``tests/inference_servers.py``) spell them again, independently, from
the same sources, and ``tests/test_inference_servers.py`` checks that the two agree, so a typo in either one
fails a test. ``dashboards/names.py`` counts them among the names a scrape can return, which lets the rules
use them. Plain data: this module never talks to a server or to Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dashboards.names import HISTOGRAM_SUFFIXES

Role = Literal["prompt_tokens", "generation_tokens", "requests"]


@dataclass(frozen=True)
class EngineSeries:
    """One metric family an engine exposes on its own /metrics."""

    family: str  # the name as exposed: a counter's with its `_total` where the engine has one, a histogram's base
    kind: Literal["counter", "histogram"]
    labels: tuple[str, ...]  # the engine's own labels (Prometheus adds the target's namespace, pod, ...)
    role: Role  # what the rules take from it (a histogram: its `_sum`, or `_count` for requests)
    source: str  # repository and file that define it

    @property
    def series(self) -> tuple[str, ...]:
        """The series names a scrape returns for the family."""
        if self.kind == "histogram":
            return tuple(f"{self.family}_{suffix}" for suffix in HISTOGRAM_SUFFIXES)
        return (self.family,)


@dataclass(frozen=True)
class Engine:
    server: str  # the rules' `server` label
    title: str
    series: tuple[EngineSeries, ...]


_VLLM = "vllm-project/vllm vllm/v1/metrics/loggers.py (PrometheusStatLogger; v0: vllm/engine/metrics.py)"
_SGLANG = "sgl-project/sglang python/sglang/srt/metrics/collector.py (TokenizerMetricsCollector)"
_TGI_VALIDATION = "huggingface/text-generation-inference router/src/validation.rs"
_TGI_SERVER = "huggingface/text-generation-inference router/src/server.rs"
_TRITON_CORE = "triton-inference-server/core src/metric_model_reporter.cc"
_TRTLLM = ("triton-inference-server/tensorrtllm_backend "
           "inflight_batcher_llm/src/custom_metrics_reporter/custom_metrics_reporter.cc")
_TRITON_VLLM = "triton-inference-server/vllm_backend src/utils/metrics.py"

VLLM = Engine("vllm", "vLLM", (
    EngineSeries("vllm:prompt_tokens_total", "counter", ("model_name", "engine"), "prompt_tokens", _VLLM),
    EngineSeries("vllm:generation_tokens_total", "counter", ("model_name", "engine"), "generation_tokens", _VLLM),
    EngineSeries("vllm:request_success_total", "counter", ("model_name", "engine", "finished_reason"), "requests",
                 _VLLM),
))
SGLANG = Engine("sglang", "SGLang", (
    EngineSeries("sglang:prompt_tokens_total", "counter", ("model_name",), "prompt_tokens", _SGLANG),
    EngineSeries("sglang:generation_tokens_total", "counter", ("model_name",), "generation_tokens", _SGLANG),
    EngineSeries("sglang:num_requests_total", "counter", ("model_name",), "requests", _SGLANG),
))
TGI = Engine("tgi", "Text Generation Inference", (
    EngineSeries("tgi_request_input_length", "histogram", (), "prompt_tokens", _TGI_VALIDATION),
    EngineSeries("tgi_request_generated_tokens", "histogram", (), "generation_tokens", _TGI_SERVER),
    EngineSeries("tgi_request_success", "counter", (), "requests", _TGI_SERVER),
))
TRITON = Engine("triton", "Triton Inference Server", (
    EngineSeries("nv_llm_input_token_len", "histogram", ("model", "version", "response_metric_type"),
                 "prompt_tokens", _TRTLLM),
    EngineSeries("nv_llm_output_token_len", "histogram", ("model", "version", "response_metric_type"),
                 "generation_tokens", _TRTLLM),
    # The vLLM backend reuses vLLM's names, labelled as Triton labels every model's series.
    EngineSeries("vllm:prompt_tokens_total", "counter", ("model", "version"), "prompt_tokens", _TRITON_VLLM),
    EngineSeries("vllm:generation_tokens_total", "counter", ("model", "version"), "generation_tokens",
                 _TRITON_VLLM),
    EngineSeries("nv_inference_count", "counter", ("model", "version"), "requests", _TRITON_CORE),
))

ENGINES: tuple[Engine, ...] = (VLLM, SGLANG, TGI, TRITON)


def engine_metric_names() -> frozenset[str]:
    """Every series name of every engine's families in the table."""
    return frozenset(name for engine in ENGINES for s in engine.series for name in s.series)
