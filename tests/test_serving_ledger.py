"""Serving sessions in the run ledger (``--collector.inference``, ``ledger.serving``): for each of vLLM, SGLang,
TGI and Triton, a stand-in server (tests/inference_servers.py: each engine's exact names, types and labels,
with the engines' source files cited there) driven through a scripted token trace on its own frozen clock, the
real inference collector scraping it over HTTP and finding its process from the listening socket in /proc
(the server is a thread of this test process: its pid is ``os.getpid()``), and the real ledger fed snapshots
of GPUs with a known constant power (``test_ledger``'s frozen-clock rig). J per output token from the ledger
within 1% of the hand value: a server on two GPUs (tensor parallel), a GPU shared with a training run (split
by SM use, 3/4 to the server), and an idle hour (idle joules, no J/token). Then a restart (a counter reset:
a new session), a slow and a hung server (the collector's scrape never holds up a snapshot), hostile output
(bounded, counted, one log line), and the database's kind column.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from inference_servers import SERVERS, Hostile, Segment, StandInServer, Trace
from test_ledger import T0, UUID_A, UUID_B, Clock, constant, gpu_state, snapshot

from gpu_energy_exporter.collectors.inference.collector import InferenceCollector
from gpu_energy_exporter.core.procinfo import ProcessIdentity
from gpu_energy_exporter.core.state import GPUProcess, GPUState
from gpu_energy_exporter.ledger import RunLedger
from gpu_energy_exporter.ledger.files import iso_utc
from gpu_energy_exporter.otlp.points import AcceptedPoint

ENGINES = ("vllm", "sglang", "tgi", "triton")
PID = os.getpid()  # the stand-in servers are threads of this process: it holds their listening sockets
TRAINER_PID = 4_000_000  # a training process NVML lists beside the server (no such pid on this host)
MODEL = "llama-3-8b"
STEP = 10.0  # one snapshot and one scrape every 10 s of the frozen clock
INTENSITY, PUE = 400.0, 1.2


class Rig:
    """A stand-in server of ``engine``, the inference collector and a ledger on one frozen clock; GPUs of known
    constant power listing the server's process (and the trainer's, with SM shares)."""

    def __init__(self, engine: str, trace: Trace, gpus: dict[str, tuple[float, dict[int, float | None]]],
                 tmp_path: Path | None = None, t0: float = T0) -> None:
        self.clock = Clock(t0)
        self.gpus = gpus  # uuid -> (watts, pid -> SM %)
        self.server: StandInServer = SERVERS[engine](MODEL, trace, clock=self.clock, wall=self.clock)
        self.server.start()
        self.collector = InferenceCollector([self.server.metrics_url], discover=False, interval_s=STEP,
                                            timeout_s=2.0, gpu_states=self.states, wall=self.clock)
        state_dir = str(tmp_path / "state") if tmp_path is not None else None
        self.ledger = RunLedger(None, warmup_s=30.0, clock=self.clock, carbon=lambda: (INTENSITY, PUE),
                                state_dir=state_dir)

    def states(self) -> tuple[GPUState, ...]:
        out = []
        for i, (uuid, (watts, procs)) in enumerate(self.gpus.items()):
            g = gpu_state(uuid, self.clock.t, constant(watts), index=i)
            assert g.reading is not None
            reading = dataclasses.replace(g.reading, processes=tuple(
                GPUProcess(pid, None, sm, ProcessIdentity(pid)) for pid, sm in procs.items()))
            out.append(dataclasses.replace(g, reading=reading))
        return tuple(out)

    def step(self, t: float, scrape: bool = True) -> None:
        self.clock.t = t
        if scrape:
            self.collector.scrape_all(wait=True)
        self.ledger.on_snapshot(dataclasses.replace(snapshot(t, self.states()), serving=self.collector.sessions()))

    def run(self, until: float, scrape: bool = True) -> None:
        t = self.clock.t
        while t + STEP <= until + 1e-9:
            t += STEP
            self.step(t, scrape)

    def serving(self) -> list[dict[str, Any]]:
        return [r for r in self.ledger.runs() if r.get("kind") == "serving"]

    def close(self) -> None:
        self.server.stop()
        self.collector.stop()


@pytest.fixture
def rigs() -> Any:
    made: list[Rig] = []

    def make(*args: Any, **kw: Any) -> Rig:
        made.append(Rig(*args, **kw))
        return made[-1]

    yield make
    for r in made:
        r.close()


def _trainer(rig: Rig, run_id: str, t: float, tokens: float) -> None:
    labels = {"run_id": run_id, "rank": "0", "gpu_uuid": UUID_A}
    resource = (("process_pid", str(TRAINER_PID)),)
    rig.ledger.on_point(AcceptedPoint(run_id, "training_tokens_total", labels, tokens, t, "counter",
                                      resource=resource))


@pytest.mark.parametrize("engine", ENGINES)
def test_j_per_output_token_of_a_server_over_two_gpus_is_the_hand_value(engine: str, rigs: Any) -> None:
    out_rate, prompt_rate = 640.0, 2560.0  # tokens per second
    rig = rigs(engine, Trace.constant(prompt=prompt_rate, output=out_rate, requests=5.0),
               {UUID_A: (300.0, {PID: None}), UUID_B: (340.0, {PID: None})})
    rig.step(T0)
    rig.run(T0 + 600)
    [s] = rig.serving()
    hand = (300.0 + 340.0) / out_rate  # 1.0 J per output token: the session holds both GPUs whole
    assert s["j_per_token"] == pytest.approx(hand, rel=0.01), s
    assert s["gpu_count"] == 2 and s["backend"] == engine and s["model"] == (engine if engine == "tgi" else MODEL)
    # (SGLang and TGI create their series with the first request: their session starts a scrape later)
    assert s["tokens"] == pytest.approx(out_rate * s["duration_s"], rel=0.01)
    assert s["prompt_tokens"] == pytest.approx(prompt_rate * s["duration_s"], rel=0.01)
    assert s["j_per_1k_tokens"] == pytest.approx(1000 * 640.0 / (out_rate + prompt_rate), rel=0.01)
    assert s["warmup_s"] == 0.0 and s["status"] == "running"
    assert s["co2_g"] == pytest.approx(640.0 * s["duration_s"] * INTENSITY * PUE / 3.6e6, rel=0.01)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_gpu_shared_with_a_training_run_is_split_by_sm_use(engine: str, rigs: Any) -> None:
    out_rate = 512.0
    rig = rigs(engine, Trace.constant(prompt=1536.0, output=out_rate, requests=4.0),
               {UUID_A: (512.0, {PID: 75.0, TRAINER_PID: 25.0})})
    rig.step(T0)
    _trainer(rig, "train-1", T0, 0.0)
    t = T0
    while t < T0 + 600:
        t += STEP
        _trainer(rig, "train-1", t, 100.0 * (t - T0))
        rig.step(t)
    [s] = rig.serving()
    train = next(r for r in rig.ledger.runs() if r["run_id"] == "train-1")
    hand = 512.0 * 0.75 / out_rate  # 0.75 J per output token
    assert s["j_per_token"] == pytest.approx(hand, rel=0.01), s
    assert "sm_util" in s["energy_split"]
    assert train["kind"] == "training"
    assert train["energy_j"] == pytest.approx(512.0 * 0.25 * 600, rel=0.01)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_idle_hour_shows_idle_joules_and_no_j_per_token(engine: str, rigs: Any) -> None:
    # One busy hour, then an idle one: the first hour's J/token is the hand value, the second has energy and
    # no J/token (never a division by zero).
    out_rate = 200.0
    start = 3600.0 * (int(T0 // 3600) + 1)  # on the hour
    rig = rigs(engine, Trace([Segment(3600.0, 800.0, out_rate, 2.0)]), {UUID_A: (250.0, {PID: None})}, t0=start)
    rig.step(start)
    rig.run(start + 7200)
    [s] = rig.serving()
    doc = rig.ledger.run(s["run_id"])
    assert doc is not None
    hours = doc["serving"]["hours"]
    assert [h["hour"] for h in hours] == [iso_utc(start), iso_utc(start + 3600)]
    busy, idle = hours[0], hours[1]
    assert busy["j_per_output_token"] == pytest.approx(250.0 / out_rate, rel=0.01), busy
    assert busy["output_tokens"] == pytest.approx(out_rate * 3600, rel=0.01)
    assert idle["output_tokens"] == 0 and idle["j_per_output_token"] is None
    assert idle["energy_j"] == pytest.approx(250.0 * 3600, rel=0.01)
    assert idle["idle_energy_j"] == pytest.approx(100.0 * 3600, rel=0.01)  # the GPU's idle power, 100 W
    assert sum(h["energy_j"] for h in hours) == pytest.approx(s["energy_j"], rel=1e-9)
    assert s["j_per_token"] == pytest.approx(250.0 * 7200 / (out_rate * 3600), rel=0.01)


def test_a_server_restart_ends_the_session_and_starts_another_counting_every_token_once(rigs: Any,
                                                                                       tmp_path: Path) -> None:
    rig = rigs("vllm", Trace.constant(prompt=400.0, output=100.0, requests=1.0), {UUID_A: (300.0, {PID: None})},
               tmp_path=tmp_path)
    rig.step(T0)
    rig.run(T0 + 300)
    rig.server.restart()  # the counters start again from 0 (same pid: the reset says it)
    rig.run(T0 + 600)
    rig.run(T0 + 700)
    runs = rig.serving()
    port = rig.server.target.rsplit(":", 1)[1]
    assert [r["run_id"] for r in runs] == [f"serving-{port}-{PID}", f"serving-{port}-{PID}.1"]
    first, second = runs
    assert first["status"] == "finished" and second["status"] == "running"
    assert first["tokens"] + second["tokens"] == pytest.approx(100.0 * 700, rel=0.01)
    assert first["energy_j"] + second["energy_j"] == pytest.approx(300.0 * 700, rel=0.01)
    assert second["j_per_token"] == pytest.approx(3.0, rel=0.01)
    rig.ledger.close()
    with sqlite3.connect(tmp_path / "state" / "runs.db") as conn:
        kinds = conn.execute("SELECT run_id, kind FROM runs").fetchall()
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    assert (first["run_id"], "serving") in kinds


def test_a_slow_or_hung_server_never_holds_up_a_snapshot(rigs: Any) -> None:
    rig = rigs("vllm", Trace.constant(output=100.0), {UUID_A: (300.0, {PID: None})})
    rig.collector.timeout_s = 5.0
    rig.step(T0)
    rig.server.hang = True
    rounds = threading.Thread(target=rig.collector.scrape_all, kwargs={"wait": True}, daemon=True)
    rounds.start()  # the collector's own thread is stuck on the hung server until its timeout
    while rig.server.scrapes < 2:  # the hung scrape has reached the server
        time.sleep(0.01)
    for i in range(1, 4):
        rig.step(T0 + i * STEP, scrape=False)  # the sampler's side: snapshots with the sessions known now
        rig.collector.update()
        rig.collector.scrape_all()  # a new round while the hung scrape runs: it is not scraped twice
    assert rounds.is_alive(), "the snapshots were taken while the scrape was still waiting on the server"
    assert rig.server.scrapes == 2, "a hung server is not scraped again while its scrape runs"
    rounds.join(15.0)
    assert not rounds.is_alive()
    text = "".join(f"{s.name}{s.labels} {s.value}\n" for f in rig.collector.update() for s in f.samples)
    assert "{'result': 'timeout'} 1.0" in text, text
    [s] = rig.serving()
    assert s["status"] == "running"  # a server late for one scrape keeps its session
    rig.server.hang = False


@pytest.mark.parametrize("hostile", [Hostile.huge_label(1 << 16), Hostile.many_series(100_000),
                                     Hostile.garbage(1 << 16), Hostile.huge_body(64 << 20)],
                         ids=lambda h: h.kind)
def test_hostile_output_is_refused_bounded_and_counted(hostile: Hostile, rigs: Any,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    rig = rigs("vllm", Trace.constant(output=100.0), {UUID_A: (300.0, {PID: None})})
    rig.collector._bounds = (16 << 20, 20_000, 2048)  # bytes, series, label bytes
    rig.step(T0)
    rig.run(T0 + 20)
    before = rig.serving()[0]["tokens"]
    rig.server.hostile = hostile
    rig.run(T0 + 60)
    rig.run(T0 + 70)
    reason = {"huge_label": "label_too_long", "many_series": "too_many_series", "garbage": "unrecognised",
              "huge_body": "too_large"}[hostile.kind]
    fams = {s.labels.get("result"): s.value for f in rig.collector.update() for s in f.samples
            if s.name == "gpuenergy_inference_scrapes_total"}
    assert fams[reason] == 5, {k: v for k, v in fams.items() if v}
    lines = [r for r in caplog.records if "inference server" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    [s] = rig.serving()
    assert s["tokens"] == before  # nothing of the hostile answers was taken


def test_runs_marks_a_serving_session_beside_a_training_run(rigs: Any) -> None:
    from gpu_energy_exporter.client.runs import runs_table

    rig = rigs("vllm", Trace.constant(prompt=1536.0, output=512.0, requests=4.0),
               {UUID_A: (512.0, {PID: 75.0, TRAINER_PID: 25.0})})
    rig.step(T0)
    _trainer(rig, "train-1", T0, 0.0)
    for i in range(1, 7):
        _trainer(rig, "train-1", T0 + i * STEP, 1000.0 * i)
        rig.step(T0 + i * STEP)
    text = runs_table(rig.ledger.runs())
    lines = {line.split()[0]: line for line in text.splitlines() if line.startswith(("train-1", "serving-"))}
    [serving_id] = [k for k in lines if k.startswith("serving-")]
    assert "(serving)" in lines[serving_id] and "(serving)" not in lines["train-1"], text
    assert "J/token is J per output token" in text
