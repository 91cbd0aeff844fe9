"""The stand-in inference servers (tests/inference_servers.py): what each exposes over HTTP agrees with the
engine table the rules use (dashboards/engines.py: names, types, labels, each spelled independently from the
engines' sources), follows its scripted token trace in whole tokens, starts again from 0 when it restarts,
creates its series when the real engine does, and misbehaves on demand (slow, hung, hostile)."""

from __future__ import annotations

import re
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from inference_servers import (
    SERVERS,
    Hostile,
    SGLangServer,
    StandInServer,
    TGIServer,
    Trace,
    TritonServer,
    VLLMServer,
)

from dashboards.engines import ENGINES, Engine

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:\\.|[^"\\])*)"')


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scrape(server: StandInServer, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=timeout) as r:
        assert r.status == 200
        return str(r.read().decode())


def parse(text: str) -> tuple[dict[str, str], list[tuple[str, dict[str, str], float]]]:
    """(family -> TYPE, [(series name as on the wire, labels, value)]) of an exposition in text format."""
    types: dict[str, str] = {}
    samples: list[tuple[str, dict[str, str], float]] = []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            samples.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return types, samples


def value(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    """The sum of the series ``name`` whose labels include ``labels``."""
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x for k, x in labels.items())]
    assert found, f"no {name} {labels}"
    return sum(found)


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _start(cls: type[StandInServer], clock: Clock, trace: Trace, **kw: str) -> StandInServer:
    return cls("llama-3-8b", trace, clock=clock, wall=lambda: 1.7e9, **kw).start()  # type: ignore[arg-type]


@pytest.fixture
def servers(clock: Clock) -> Iterator[dict[str, StandInServer]]:
    trace = Trace.constant(prompt=1536, output=512, requests=4, cached=64)
    made = {"vllm": _start(VLLMServer, clock, trace), "sglang": _start(SGLangServer, clock, trace),
            "tgi": _start(TGIServer, clock, trace), "triton": _start(TritonServer, clock, trace),
            "triton-vllm": _start(TritonServer, clock, trace, backend="vllm")}
    clock.now += 10.0
    yield made
    for s in made.values():
        s.stop()


def _families(engine: Engine, backend: str) -> list:  # type: ignore[type-arg]
    """The table's families a stand-in of ``engine`` (Triton: with ``backend``) exposes."""
    if engine.server != "triton":
        return list(engine.series)
    vllm_names = backend == "vllm"
    return [s for s in engine.series if s.family == "nv_inference_count" or s.family.startswith("vllm:") == vllm_names]


_CASES = [(e, k) for e in ENGINES for k in (("triton", "triton-vllm") if e.server == "triton" else (e.server,))]


@pytest.mark.parametrize(("engine", "key"), _CASES, ids=[k for _, k in _CASES])
def test_the_stand_ins_expose_the_names_types_and_labels_the_rules_read(
        servers: dict[str, StandInServer], engine: Engine, key: str) -> None:
    types, samples = parse(scrape(servers[key]))
    for s in _families(engine, "vllm" if key == "triton-vllm" else "tensorrtllm"):
        # prometheus_client (vLLM, SGLang) types a counter by its name without `_total`
        declared = types.get(s.family, types.get(s.family.removesuffix("_total")))
        assert declared == s.kind, (key, s.family, types)
        for name in s.series:
            got = [lab for n, lab, _ in samples if n == name]
            assert got, (key, name)
            expected = set(s.labels) | ({"le"} if name.endswith("_bucket") else set())
            assert all(set(lab) == expected for lab in got), (key, name, got)
    # Only what the real engine defines: every family on the wire is the engine's (or an extra of its own that
    # the rules do not read), and none of our own.
    assert not [n for n, _, _ in samples if n.startswith("gpuenergy_")]


def test_the_stand_ins_follow_the_trace_in_whole_tokens(servers: dict[str, StandInServer], clock: Clock) -> None:
    # 10 s at 1536 prompt, 512 output tokens/s and 4 requests/s.
    _, vllm = parse(scrape(servers["vllm"]))
    assert value(vllm, "vllm:prompt_tokens_total") == 15360
    assert value(vllm, "vllm:generation_tokens_total") == 5120
    assert value(vllm, "vllm:request_success_total") == 40  # over finished_reason stop, length, abort
    _, sglang = parse(scrape(servers["sglang"]))
    assert value(sglang, "sglang:prompt_tokens_total") == 15360
    assert value(sglang, "sglang:cached_tokens_total") == 640
    assert value(sglang, "sglang:num_requests_total") == 40
    _, tgi = parse(scrape(servers["tgi"]))
    assert value(tgi, "tgi_request_input_length_sum") == 15360
    assert value(tgi, "tgi_request_generated_tokens_sum") == 5120
    assert value(tgi, "tgi_request_generated_tokens_bucket", le="+Inf") == 40
    assert value(tgi, "tgi_request_success") == 40
    _, triton = parse(scrape(servers["triton"]))
    assert value(triton, "nv_llm_input_token_len_sum", response_metric_type="total_input_tokens") == 15360
    assert value(triton, "nv_llm_output_token_len_sum", response_metric_type="total_output_tokens") == 5120
    assert value(triton, "nv_inference_count", model="llama-3-8b", version="1") == 40
    # A third of a second later: whole tokens only (512 / 3 = 170.67 -> 170).
    clock.now += 1 / 3
    _, vllm = parse(scrape(servers["vllm"]))
    assert value(vllm, "vllm:generation_tokens_total") == 5120 + 170
    assert servers["vllm"].totals().output == 5290


def test_a_restart_starts_every_counter_again_from_zero_on_the_same_port(clock: Clock) -> None:
    trace = Trace.constant(prompt=100, output=50, requests=1)
    with VLLMServer("m", trace, clock=clock) as server:
        port = server.target
        clock.now += 20.0
        _, before = parse(scrape(server))
        assert value(before, "vllm:generation_tokens_total") == 1000
        created = value(before, "vllm:generation_tokens_created")
        time.sleep(0.01)
        server.restart()
        assert server.target == port
        _, after = parse(scrape(server))
        assert value(after, "vllm:generation_tokens_total") == 0  # a counter reset, as rate() sees one
        assert value(after, "vllm:generation_tokens_created") > created
        clock.now += 4.0
        _, later = parse(scrape(server))
        assert value(later, "vllm:generation_tokens_total") == 200  # the load goes on along the trace


def test_a_new_trace_carries_on_from_the_counters_and_idle_stays_flat(clock: Clock) -> None:
    with TritonServer("m", Trace.constant(output=10, requests=1), clock=clock) as server:
        clock.now += 5.0
        server.set_trace(Trace.idle())
        clock.now += 3600.0
        _, idle = parse(scrape(server))
        assert value(idle, "nv_llm_output_token_len_sum") == 50
        server.set_trace(Trace.constant(output=2))
        clock.now += 5.0
        assert server.totals().output == 60


def test_sglang_and_tgi_create_their_series_with_the_first_finished_request(clock: Clock) -> None:
    # vLLM and Triton create theirs (at 0) when the engine or model starts; SGLang's tokenizer and TGI's
    # recorder only when the first request is counted.
    for cls, name in ((SGLangServer, "sglang:generation_tokens_total"), (TGIServer, "tgi_request_generated_tokens_sum"),
                      (VLLMServer, "vllm:generation_tokens_total"), (TritonServer, "nv_llm_output_token_len_sum")):
        with cls("m", Trace.constant(output=10, requests=0.5), clock=clock) as server:
            _, samples = parse(scrape(server))
            present = any(n == name for n, _, _ in samples)
            assert present == (cls in (VLLMServer, TritonServer)), cls.engine
            clock.now += 2.0
            _, samples = parse(scrape(server))
            assert value(samples, name) == 20, cls.engine


def test_a_slow_server_answers_late_and_a_hung_one_never(clock: Clock) -> None:
    with TGIServer("m", Trace.constant(output=10, requests=1), clock=clock) as server:
        clock.now += 1.0
        server.delay_s = 1.5
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            scrape(server, timeout=0.3)
        assert "tgi_request_success 1" in scrape(server, timeout=30.0)  # it does answer, late
        server.delay_s = 0.0
        server.hang = True
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            scrape(server, timeout=0.5)
        started = time.monotonic()
    assert time.monotonic() - started < 10.0  # stop() does not wait for the hung answer


def test_a_stopped_server_refuses_connections(clock: Clock) -> None:
    server = SGLangServer("m", clock=clock).start()
    host, port = server.target.split(":")
    server.stop()
    with pytest.raises(OSError), socket.create_connection((host, int(port)), timeout=2.0):
        pass


@pytest.mark.parametrize("engine", sorted(SERVERS))
def test_hostile_output(engine: str, clock: Clock) -> None:
    with SERVERS[engine]("m", Trace.constant(prompt=10, output=10, requests=1), clock=clock) as server:
        clock.now += 1.0
        server.hostile = Hostile.huge_label(100_000)
        assert ('="' + "m" * 100_000 + '"') in scrape(server)
        server.hostile = Hostile.many_series(5000)
        _, samples = parse(scrape(server))
        assert len(samples) > 5000
        server.hostile = Hostile.garbage(4096)
        body = urllib.request.urlopen(server.metrics_url, timeout=10).read()
        assert len(body) == 4096 and b"\x00" in body
        server.hostile = Hostile.huge_body(8 << 20)
        assert len(scrape(server)) >= 8 << 20
