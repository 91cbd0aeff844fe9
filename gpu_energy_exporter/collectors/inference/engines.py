"""What an inference server's /metrics says about its tokens: the engine recognised by its metric names, and per
model the prompt tokens, output tokens and finished requests, from the Prometheus text format, within bounds.

The names (docs/inference.md; ``dashboards/engines.py`` cites each engine's source file):

- vLLM: ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, ``vllm:request_success_total`` (label
  ``model_name``; ``engine`` and ``finished_reason`` summed);
- SGLang: ``sglang:prompt_tokens_total``, ``sglang:generation_tokens_total``, ``sglang:num_requests_total``
  (``model_name``);
- TGI: the histograms' sums ``tgi_request_input_length_sum``, ``tgi_request_generated_tokens_sum`` and the
  counter ``tgi_request_success`` (no labels: one unnamed model);
- Triton: ``nv_llm_input_token_len_sum`` / ``nv_llm_output_token_len_sum`` (TensorRT-LLM backend),
  or vLLM's names with the label ``model`` (vLLM backend), and ``nv_inference_count`` (``model``; ``version``
  summed).

Only lines of these names are parsed; every sample line counts against ``max_series`` and a label value
longer than ``max_label_bytes`` refuses the whole answer (``Refused``, with a reason the collector counts):
what a hostile server sends costs bounded time and memory and never reaches the ledger. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

VLLM, SGLANG, TGI, TRITON = "vllm", "sglang", "tgi", "triton"
ENGINES = (VLLM, SGLANG, TGI, TRITON)
PROMPT, OUTPUT, REQUESTS = 0, 1, 2

#: metric name -> (engine, which count, the label naming the model, required labels)
_NAMES: dict[str, tuple[str, int, str, Mapping[str, str]]] = {
    "vllm:prompt_tokens_total": (VLLM, PROMPT, "model_name", {}),
    "vllm:generation_tokens_total": (VLLM, OUTPUT, "model_name", {}),
    "vllm:request_success_total": (VLLM, REQUESTS, "model_name", {}),
    "sglang:prompt_tokens_total": (SGLANG, PROMPT, "model_name", {}),
    "sglang:generation_tokens_total": (SGLANG, OUTPUT, "model_name", {}),
    "sglang:num_requests_total": (SGLANG, REQUESTS, "model_name", {}),
    "tgi_request_input_length_sum": (TGI, PROMPT, "", {}),
    "tgi_request_generated_tokens_sum": (TGI, OUTPUT, "", {}),
    "tgi_request_success": (TGI, REQUESTS, "", {}),
    "nv_llm_input_token_len_sum": (TRITON, PROMPT, "model", {"response_metric_type": "total_input_tokens"}),
    "nv_llm_output_token_len_sum": (TRITON, OUTPUT, "model", {"response_metric_type": "total_output_tokens"}),
    "nv_inference_count": (TRITON, REQUESTS, "model", {}),
}


class Refused(ValueError):
    """The answer is refused whole: ``reason`` is the counter's label, the message says what and how much."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Reading:
    """One answer: the engine and, per model, [prompt tokens, output tokens, requests]."""

    engine: str
    models: dict[str, list[float]]


def _labels(text: str, max_label_bytes: int) -> dict[str, str]:
    """The labels of ``{a="x",b="y"}`` (without the braces), escapes undone."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        eq = text.find("=", i)
        if eq < 0:
            break
        name = text[i:eq].strip().lstrip(",").strip()
        if eq + 1 >= n or text[eq + 1] != '"':
            raise Refused("malformed", f"a label value is not quoted near {text[i:i + 40]!r}")
        j, buf = eq + 2, []
        while j < n and text[j] != '"':
            if text[j] == "\\" and j + 1 < n:
                buf.append({"n": "\n"}.get(text[j + 1], text[j + 1]))
                j += 2
            else:
                buf.append(text[j])
                j += 1
        value = "".join(buf)
        if len(value) > max_label_bytes:
            raise Refused("label_too_long", f"a value of label {name[:40]!r} is {len(value)} bytes long "
                          f"(at most {max_label_bytes})")
        out[name] = value
        i = j + 1
    return out


def parse(text: str, *, max_series: int, max_label_bytes: int) -> Reading:
    """The engine and per-model counts of one /metrics answer. Raises ``Refused`` (too many series, a label
    too long, a token line that does not parse) or returns an empty engine when no known name is there."""
    found: dict[tuple[str, str], list[float]] = {}
    engines: set[str] = set()
    vllm_model_label = False
    series = 0
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        series += 1
        if series > max_series:
            raise Refused("too_many_series", f"more than {max_series} series")
        brace = line.find("{")
        space = line.find(" ")
        end = brace if 0 <= brace < space or (brace >= 0 > space) else space
        name = line[:end] if end >= 0 else line
        spec = _NAMES.get(name)
        if spec is None:
            continue
        engine, which, model_label, required = spec
        labels: dict[str, str] = {}
        rest = line[end:]
        if rest.startswith("{"):
            close = rest.rfind("}")
            if close < 0:
                raise Refused("malformed", f"{name}: labels not closed")
            labels = _labels(rest[1:close], max_label_bytes)
            rest = rest[close + 1:]
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            raise Refused("malformed", f"{name}: no number in {rest[:40]!r}") from None
        if not math.isfinite(value) or value < 0:
            raise Refused("malformed", f"{name}: {value} is not a token count")
        if any(labels.get(k) != v for k, v in required.items()):
            continue
        if engine == VLLM and "model" in labels and "model_name" not in labels:
            engine, model_label, vllm_model_label = TRITON, "model", True  # Triton's vLLM backend
        model = labels.get(model_label, "") if model_label else ""
        engines.add(engine)
        counts = found.setdefault((engine, model), [0.0, 0.0, 0.0])
        counts[which] += value
    if vllm_model_label:
        engines.discard(VLLM)
    if not engines:
        return Reading("", {})
    # One engine per server; were several names present (a proxy in front of two), the first in ENGINES wins.
    engine = next(e for e in ENGINES if e in engines)
    return Reading(engine, {m: c for (e, m), c in found.items() if e == engine})
