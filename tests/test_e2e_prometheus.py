"""End to end: the exporter on the fake NVML library, a real tiny PyTorch training loop pushing over OTLP,
and a real Prometheus on loopback scraping the exporter with the bundled recording rules loaded.

One session serves both checks (each needs a minute of history):
- Prometheus's ``rate(gpuenergy_gpu_energy_joules_total[1m])`` matches the scenario's true power within
  1%. ``rate()`` over 1m is only exact once the series has a full minute of history (before that
  Prometheus extrapolates from a partial window), so the checks run after 65 s of scraping.
- The J/token recording rule, read through Prometheus's HTTP API, matches the run ledger within 2%.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakenvml import Constant, Process, Scenario, Square, h100, v100
from helpers import ROOT, ExporterProcess, wait_until
from prom import Prometheus

pytestmark = pytest.mark.slow

#: NVML lists the trainer (a thread of this process) on the GPUs it uses: a claim no listed process confirms
#: is charged nothing after --runs.claim-grace (issue 19).
TRAINER = (Process(os.getpid(), 1 << 30, 90),)
GPUS = [
    h100(0, power=Constant(312.0), energy_offset_mj=4_000_000_000, processes=TRAINER),
    # bursty training steps: 80 ms period, 60% at 650 W, 40% at 120 W -> 438 W mean
    h100(1, power=Square(120.0, 650.0, 0.08, 0.6), processes=TRAINER),
    v100(2, power=Constant(151.5)),
]
TRUE_MEAN_W = {GPUS[0].uuid: 312.0, GPUS[1].uuid: 438.0, GPUS[2].uuid: 151.5}
RUN_ID = "e2e-jpt"
TOKENS_PER_STEP = 2048
STEP_S = 0.05  # paced: ~40,960 tokens/s at most; a loaded machine runs slower
MIN_STEPS = 300  # 1300 at the pace over the 65 s the fixture waits; 300 is reached on a loaded 2-core machine


class Session:
    def __init__(self, exporter: ExporterProcess, prom: Prometheus) -> None:
        self.exporter, self.prom = exporter, prom
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.steps = 0
        self.started: float | None = None  # wall time just before the first step

    def progress(self) -> tuple[int, float]:
        """(steps taken, seconds since the first step began), read together."""
        steps, now = self.steps, time.time()
        return steps, now - (self.started if self.started is not None else now)

    def train(self) -> None:
        """A real tiny PyTorch LM, trained on synthetic ids, reporting through the training helper."""
        try:
            import torch
            from training_models import TinyLM, TinyLMConfig, synthetic_tokens

            from gpu_energy_exporter.training import start_run

            cfg = TinyLMConfig()
            model = TinyLM(cfg)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            batch = synthetic_tokens(TOKENS_PER_STEP // cfg.seq_len, cfg)
            run = start_run(RUN_ID, model="tiny-lm", backend="eager", batch_size=len(batch), seq_len=cfg.seq_len,
                            precision="fp32", endpoint=self.exporter.otlp_url, export_interval=1.0,
                            gpu_uuids=[GPUS[0].uuid, GPUS[1].uuid])
            next_step = time.monotonic()
            self.started = time.time()
            while not self.stop.is_set():
                loss = model.loss(batch)
                loss.backward()
                opt.step()
                opt.zero_grad()
                run.step(tokens=TOKENS_PER_STEP, samples=len(batch), loss=loss)
                self.steps += 1
                next_step += STEP_S
                time.sleep(max(0.0, next_step - time.monotonic()))
            run.finish()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


@pytest.fixture(scope="module")
def session(fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Session]:
    tmp = tmp_path_factory.mktemp("e2e")
    Scenario(epoch=time.time() - 3600, gpus=GPUS).write(tmp / "scenario.ini")
    exporter = ExporterProcess(
        [f"--nvml.library={fake_nvml_lib}", "--collector.interval=1s", "--runs.warmup=0s"],
        {"FAKE_NVML_SCENARIO": str(tmp / "scenario.ini")},
    ).wait_ready()
    rules = [ROOT / "dashboards" / "rules" / "recording.yaml"]
    prom = None
    try:
        prom = Prometheus(tmp / "prom", [urllib.parse.urlparse(exporter.metrics_url).netloc], rule_files=rules)
        s = Session(exporter, prom)
        wait_until(lambda: prom.value('up{job="gpu-energy-exporter"}') == 1.0, timeout=30, what="first scrape")
        trainer = threading.Thread(target=s.train, daemon=True)
        trainer.start()
        time.sleep(65)
        # A loaded machine runs fewer steps than the pace allows: wait for enough of them (bounded).
        wait_until(lambda: s.steps >= MIN_STEPS or s.error is not None, timeout=120, interval=1.0,
                   what=f"{MIN_STEPS} training steps")
        yield s
        s.stop.set()
        trainer.join(30)
    finally:
        if prom is not None:
            prom.stop()
        exporter.stop()


def test_prometheus_rate_of_the_energy_counter_matches_true_power(session: Session) -> None:
    for uuid, true_mean in TRUE_MEAN_W.items():
        rate = session.prom.value(f'rate(gpuenergy_gpu_energy_joules_total{{gpu_uuid="{uuid}"}}[1m])')
        assert rate == pytest.approx(true_mean, rel=0.01), (uuid, rate)
    assert session.prom.value('max_over_time(gpuenergy_collector_success{collector="gpu"}[1m])') == 1.0
    assert session.prom.value("sum(resets(gpuenergy_gpu_energy_joules_total[1m]))") == 0.0
    assert session.prom.value(f'gpuenergy_gpu_power_watts{{gpu_uuid="{GPUS[0].uuid}"}}') == pytest.approx(312.0)


def test_jpt_recording_rule_matches_the_run_ledger(session: Session) -> None:
    import json
    import urllib.request

    assert session.error is None, session.error
    steps, elapsed = session.progress()
    assert steps >= MIN_STEPS
    with urllib.request.urlopen(session.exporter.metrics_url + "/api/v1/runs", timeout=10) as r:
        runs: list[dict[str, Any]] = json.load(r)["runs"]
    (ledger,) = [doc for doc in runs if doc["run_id"] == RUN_ID]
    assert ledger["status"] == "running"
    rule = session.prom.value(f'run_id:training_energy_joules_per_token:ratio_rate5m{{run_id="{RUN_ID}"}}')
    assert rule is not None, "the J/token recording rule has no value for the run"
    # The rule and the ledger count the same energy and tokens over windows a scrape apart (the rule's rate()
    # over 1 s scrapes that a loaded machine takes late, the ledger's from the run's first point to its last
    # snapshot): 2.1% apart was seen once on two loaded cores (issue 32), so 4%; an attribution error is
    # far outside it (GPU 2 charged too +20%, one GPU missing -42%, tokens counted twice -50%).
    assert ledger["j_per_token"] == pytest.approx(rule, rel=0.04), (ledger["j_per_token"], rule)
    # The run uses GPUs 0 and 1: 312 W + 438 W = 750 W, at the token rate the trainer actually achieved
    # (its own step count over its own elapsed time; the pace is an upper bound a loaded machine misses).
    # The ledger's window (first OTLP point to the last snapshot, tokens lagging by up to one export
    # interval) differs from the trainer's by a second or two of ~65+: a few %. A wrong attribution is far
    # outside 8%: GPU 2 charged too +20%, one GPU missing -42% or -58%, tokens counted twice -50%.
    expected = 750.0 / (steps * TOKENS_PER_STEP / elapsed)
    assert expected * 0.92 <= ledger["j_per_token"] <= expected * 1.08, (ledger["j_per_token"], expected, steps)
    # Throughput of a run younger than the 5m window: the rule divides by the run's active time, so it
    # matches the ledger; a plain rate() divides by the whole 300 s range and reads far too low.
    tokens_rule = session.prom.value(f'run_id:training_tokens:rate5m{{run_id="{RUN_ID}"}}')
    assert tokens_rule == pytest.approx(ledger["tokens_per_s"], rel=0.02)
    plain = session.prom.value(f'sum(rate(training_tokens_total{{run_id="{RUN_ID}"}}[5m]))')
    assert plain is not None and plain < 0.5 * tokens_rule
