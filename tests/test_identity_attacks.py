"""Issue 29, items 1-3: a neighbour on the node, another process pushing well-formed OTLP over loopback with
default settings, can neither forge, flood nor pre-empt its way into another run's figures.

The victim is a real trainer (the training helper, the real OpenTelemetry SDK) in the test process, which the
fake NVML library lists on the GPU; the neighbour is another process (``neighbour.push``), as it is on a real
node. Each attack is a row of the issue's table; each test checks what the victim's run must keep: its tokens
(exact), its energy (the GPU's true energy over the run: it is alone on it) and its single ledger row.
"""

from __future__ import annotations

import csv
import json
import os
import time
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import neighbour
import pytest
from fakenvml import Constant, Process, Scenario, h100
from helpers import ExporterProcess, sample_value, samples, wait_until

from gpu_energy_exporter.training import start_run

GIB = 1 << 30
STEP_TOKENS = 100


@dataclass
class Node:
    exp: ExporterProcess
    gpu: str
    csv: Path
    scenario: Scenario


@pytest.fixture
def node(start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> Iterator[Node]:
    """An exporter (default identity and limit settings) on one fake H100 drawing 300 W, on which NVML lists
    the test process (the victim's trainer)."""
    gpus = [h100(0, power=Constant(300.0), processes=(Process(os.getpid(), GIB, 90),))]
    scenario = Scenario(epoch=time.time() - 60, gpus=gpus)
    scenario.write(tmp_path / "scenario.ini")
    csv_path = tmp_path / "ledger" / "runs.csv"
    exp = start_exporter([f"--nvml.library={fake_nvml_lib}", "--collector.interval=200ms", "--runs.warmup=0s",
                          f"--runs.csv={csv_path}"],
                         {"FAKE_NVML_SCENARIO": str(tmp_path / "scenario.ini")}).wait_ready()
    wait_until(lambda: sample_value(exp.metrics(), "gpuenergy_gpu_compute_processes", gpu="0") == 1, timeout=30,
               what="the exporter to list the trainer on the GPU")
    yield Node(exp, gpus[0].uuid, csv_path, scenario)


# ----------------------------------------------------------------------------------------------------
# OTLP JSON as the neighbour writes it


def _attrs(labels: Mapping[str, str]) -> list[dict[str, Any]]:
    return [{"key": k, "value": {"stringValue": v}} for k, v in labels.items()]


def _sum(name: str, value: float, labels: Mapping[str, str], t_ns: int, start_ns: int = 0) -> dict[str, Any]:
    point = {"attributes": _attrs(labels), "startTimeUnixNano": str(start_ns or t_ns), "timeUnixNano": str(t_ns),
             "asDouble": value}
    return {"name": name, "unit": "{token}" if name == "training.tokens" else "",
            "sum": {"aggregationTemporality": 2, "isMonotonic": True, "dataPoints": [point]}}


def _gauge(name: str, value: float, labels: Mapping[str, str], t_ns: int) -> dict[str, Any]:
    return {"name": name, "gauge": {"dataPoints": [{"attributes": _attrs(labels), "timeUnixNano": str(t_ns),
                                                    "asDouble": value}]}}


def _doc(metrics: list[dict[str, Any]], resource: Mapping[str, str] | None = None) -> dict[str, Any]:
    rm: dict[str, Any] = {"scopeMetrics": [{"metrics": metrics}]}
    if resource:
        rm["resource"] = {"attributes": _attrs(resource)}
    return {"resourceMetrics": [rm]}


# ----------------------------------------------------------------------------------------------------
# the victim


def _train(node: Node, run_id: str, steps: int, between: Any = None, pause: float = 0.05) -> int:
    """The victim: ``steps`` steps of ``STEP_TOKENS`` through the helper, ``between`` called half-way, then
    finish. Returns the tokens it counted."""
    run = start_run(run_id, model="tiny", endpoint=node.exp.otlp_url, export_interval=0.3, gpu_uuids=[node.gpu],
                    environ={})
    for i in range(steps):
        run.step(tokens=STEP_TOKENS, samples=1, loss=1.0)
        time.sleep(pause)
        if i == steps // 2 and between is not None:
            between()
    run.finish()
    return steps * STEP_TOKENS


def _get(node: Node, path: str) -> Any:
    with urllib.request.urlopen(node.exp.metrics_url + path, timeout=10) as r:
        return json.loads(r.read())


def _rows(node: Node) -> list[dict[str, str]]:
    if not node.csv.exists():
        return []
    with node.csv.open(newline="") as f:
        return list(csv.DictReader(f))


def _victim_is_exact(node: Node, run_id: str, tokens: int) -> dict[str, Any]:
    """The victim's run finished with exactly its tokens, the GPU's true energy over its time (it is alone on
    the GPU) and one ledger row; its series on /metrics say the same."""
    [row] = wait_until(lambda: [r for r in _rows(node) if r["run_id"] == run_id] or None, timeout=30,
                       what=f"the row of {run_id}")
    assert float(row["tokens"]) == tokens
    time.sleep(0.5)
    assert [r["run_id"] for r in _rows(node)].count(run_id) == 1
    doc = _get(node, "/api/v1/run?id=" + urllib.request.quote(run_id))
    assert doc["status"] == "finished" and doc["tokens"] == tokens
    truth = node.scenario.true_energy_j(0, doc["start_unix"], doc["end_unix"])
    assert doc["energy_j"] == pytest.approx(truth, rel=0.02), (doc["energy_j"], truth)
    assert float(row["energy_j"]) == pytest.approx(doc["energy_j"], rel=1e-6)
    exposed = [v for labels, v in samples(node.exp.metrics(), "training_tokens_total")
               if labels.get("run_id") == run_id]
    assert sum(exposed) == tokens, exposed
    return doc


def _labels_of(node: Node, run_id: str) -> dict[str, str]:
    def found() -> dict[str, str] | None:
        for labels, _ in samples(node.exp.metrics(), "training_tokens_total"):
            if labels.get("run_id") == run_id:
                return labels
        return None
    return wait_until(found, timeout=20, what=f"run {run_id} on /metrics")


def _resource_of(node: Node, pid: int) -> dict[str, str]:
    """What target_info says of the process ``pid``: its host.name, process.pid, service.instance.id."""
    for labels, _ in samples(node.exp.metrics(), "target_info"):
        if labels.get("process_pid") == str(pid):
            return {"host.name": labels["host_name"], "process.pid": labels["process_pid"],
                    "service.instance.id": labels["service_instance_id"], "service.name": labels["service_name"]}
    raise AssertionError(f"no target_info for pid {pid}")


# ----------------------------------------------------------------------------------------------------
# the table of issue 29


def test_a_forged_copy_of_the_victims_series_is_kept_apart(node: Node) -> None:
    """Before: the ledger refused it, the store kept it and the victim's next point folded it in:
    6,000 -> 1,000,021,000 tokens."""
    answers: list[tuple[int, int, str]] = []

    def attack() -> None:
        labels = _labels_of(node, "victim")  # readable by anyone who can scrape
        now = time.time_ns()
        answers.extend(neighbour.push(node.exp.address("otlp"), [
            {"doc": _doc([_sum("training.tokens", 1e9, labels, now)])},
            {"doc": _doc([_sum("training.tokens", 2e9, labels, now + 10**8, now)]), "proto": True},
        ]))
        time.sleep(1.0)  # a few of the victim's exports and snapshots with the forged series around

    tokens = _train(node, "victim", 60, attack)
    _victim_is_exact(node, "victim", tokens)
    # The neighbour's points were not lost nor mixed in: counted under its own scoped run id, and told so.
    assert all(status == 200 and rejected == 0 for status, rejected, _ in answers), answers
    assert "belongs to another identity" in answers[0][2] and "victim~pid" in answers[0][2]
    text = node.exp.metrics()
    theirs = [v for labels, v in samples(text, "training_tokens_total") if labels["run_id"].startswith("victim~")]
    assert theirs == [2e9]
    assert (sample_value(text, "gpuenergy_otlp_run_id_collisions_total") or 0) >= 2


def test_24000_junk_series_from_one_client_never_lock_out_another(node: Node) -> None:
    """Before: the store's global bound (20,000) filled and a later run from another process got series_limit
    and never appeared."""
    now = time.time_ns()
    requests = []
    for r in range(12):  # 2,000 new series a request and a run id (--otlp.max-new-series-per-request, -per-run)
        metrics = [_gauge("junk.gauge", 1.0, {"run_id": f"junk-{r}", "junk": str(i)}, now) for i in range(2000)]
        requests.append({"doc": _doc(metrics), "proto": True})
    answers = neighbour.push(node.exp.address("otlp"), requests)
    stored = sum(2000 - rejected for _, rejected, _ in answers)
    assert stored == 5000  # --otlp.max-series-per-client
    assert "client_series_limit" in answers[-1][2]
    tokens = _train(node, "after-junk", 20)
    _victim_is_exact(node, "after-junk", tokens)
    assert sample_value(node.exp.metrics(), "gpuenergy_otlp_points_rejected_total", reason="series_limit") == 0


def test_3000_run_ids_from_rotating_loopback_addresses_are_one_identity(node: Node) -> None:
    """Before: per-client bounds counted by peer address: 256 runs active in 0.5 s, the victim's run rejected;
    196 junk CSV rows in 5 s (bound: 60 a minute)."""
    started = time.monotonic()

    def flood(finish: bool) -> None:
        requests = []
        for r in range(188):  # 16 new run ids a request (--otlp.max-new-runs-per-request), 3,008 in all
            now = time.time_ns()
            metrics = []
            for i in range(16):
                labels = {"run_id": f"junk-{r * 16 + i}", "rank": "0", "gpu_uuid": node.gpu}
                metrics.append(_sum("training.tokens", 1, labels, now))
                if finish:
                    metrics.append(_gauge("training.run.finished", 1, labels, now))
            requests.append({"doc": _doc(metrics), "proto": bool(r % 2),
                             "source": f"127.0.{1 + r // 250}.{1 + r % 250}"})
        neighbour.push(node.exp.address("otlp"), requests)

    flood(finish=False)
    tokens = _train(node, "victim", 20)
    doc = _victim_is_exact(node, "victim", tokens)
    # Then the neighbour finishes its runs: one row a second at most. (Its finished runs can push the victim's
    # out of the ledger's memory of the last 100 finished runs, /api/v1/runs; its CSV row and JSON stay.)
    flood(finish=True)
    [row] = [r for r in _rows(node) if r["run_id"] == "victim"]
    assert float(row["tokens"]) == tokens and float(row["energy_j"]) == pytest.approx(doc["energy_j"], rel=1e-6)
    text = node.exp.metrics()
    assert (sample_value(text, "gpuenergy_ledger_points_refused_total", reason="client_new_runs") or 0) > 2000
    junk = [r for r in _get(node, "/api/v1/runs")["runs"] if r["run_id"].startswith("junk-")]
    assert len([r for r in junk if r["status"] == "running"]) <= 64  # --runs.max-active-per-client
    time.sleep(1.0)
    junk_rows = [r for r in _rows(node) if r["run_id"].startswith("junk-")]
    elapsed_min = (time.monotonic() - started) / 60
    assert len(junk_rows) <= 60 * (1 + elapsed_min), len(junk_rows)  # a minute's bucket, then 60 a minute


def test_a_finish_forged_from_target_info_leaves_the_run_going(node: Node) -> None:
    """Before: the victim's host.name, process.pid and service.instance.id read from target_info and
    training_run_finished=1 pushed with them: accepted, the run closed early, its next 16 s ignored."""
    answers: list[tuple[int, int, str]] = []
    started = time.monotonic()

    def attack() -> None:
        labels = _labels_of(node, "victim")
        resource = _resource_of(node, os.getpid())
        now = time.time_ns()
        without_pid = {k: v for k, v in resource.items() if k != "process.pid"}
        answers.extend(neighbour.push(node.exp.address("otlp"), [
            {"doc": _doc([_gauge("training.run.finished", 1, labels, now)], resource)},
            {"doc": _doc([_gauge("training.run.finished", 1, labels, now)], resource), "proto": True},
            {"doc": _doc([_gauge("training.run.finished", 1, labels, now)], without_pid)},
        ]))
        time.sleep(1.0)

    tokens = _train(node, "victim", 60, attack)
    elapsed = time.monotonic() - started
    doc = _victim_is_exact(node, "victim", tokens)
    assert doc["duration_s"] > 0.6 * elapsed
    # a process.pid that is not the pushing process: refused, and said why
    assert answers[0][1] == 1 and "not the pushing process" in answers[0][2]
    assert answers[1][1] == 1
    # the victim's other claims without the pid: the neighbour's own run (scoped), not the victim's
    assert answers[2][1] == 0 and "belongs to another identity" in answers[2][2]
    assert (sample_value(node.exp.metrics(), "gpuenergy_otlp_points_rejected_total", reason="identity_mismatch")
            or 0) >= 2


def test_a_run_id_taken_first_by_a_neighbour_still_counts_the_victims_run(node: Node) -> None:
    """Before: one token pushed under a future run id (Slurm job ids are predictable, and so is the helper's
    default run id) refused all 36 of the victim's pushes; its row read 1 token, 0 J."""
    now = time.time_ns()
    [answer] = neighbour.push(node.exp.address("otlp"), [
        {"doc": _doc([_sum("training.tokens", 1, {"run_id": "job-4242", "rank": "0", "gpu_uuid": node.gpu}, now)])}])
    assert answer[:2] == (200, 0)
    tokens = _train(node, "job-4242", 36, pause=0.1)
    scoped = f"job-4242~pid{os.getpid()}"  # the victim's run, scoped to it: its own row, all of its tokens
    _victim_is_exact(node, scoped, tokens)
    runs = {r["run_id"]: r for r in _get(node, "/api/v1/runs")["runs"]}
    assert runs["job-4242"]["tokens"] == 1  # the squatter's run keeps what it pushed and nothing else
    # both runs say what happened
    assert f"another identity (pid{os.getpid()}) pushed under this run id" in runs["job-4242"]["ledger_notes"]
    assert "pushed under run id 'job-4242', which another identity holds" in runs[scoped]["ledger_notes"]
