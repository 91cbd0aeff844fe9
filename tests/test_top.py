"""``gpu-energy-exporter top``: driven in a real terminal (tmux) against the exporter on the fake NVML
library with a training run pushing; plain-text frames without a terminal; basic auth and TLS; the
unreachable-exporter message."""

from __future__ import annotations

import io
import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
from cryptography import x509
from fakenvml import Constant, Scenario, h100
from helpers import ROOT, ExporterProcess, free_port, wait_until
from test_web import issue

from gpu_energy_exporter.client import fmt, top
from gpu_energy_exporter.client.api import ExporterClient
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend
from gpu_energy_exporter.training import TrainingRun, start_run

FAST = ["--collector.interval=200ms", "--runs.warmup=0s"]


# ----------------------------------------------------------------------------------------------------
# a real terminal: tmux


class Tmux:
    """A private tmux server (its own socket) with one session per ``start``."""

    def __init__(self) -> None:
        binary = shutil.which("tmux")
        if binary is None:
            pytest.skip("tmux is not installed (Debian: apt-get install tmux); the terminal tests need it")
        self.binary = binary
        self.socket = f"gee-top-{uuid.uuid4().hex[:8]}"

    def _run(self, *args: str) -> str:
        out = subprocess.run([self.binary, "-L", self.socket, *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def start(self, name: str, command: str, width: int = 120, height: int = 32) -> None:
        env = f"env TERM=xterm-256color LANG=C.UTF-8 LC_ALL=C.UTF-8 PYTHONPATH={ROOT}"
        # The pane outlives the command so the test can read what it left and its exit status.
        shell = f"{env} {command}; echo TOP-EXITED rc=$?; sleep 120"
        self._run("new-session", "-d", "-s", name, "-x", str(width), "-y", str(height), "-c", str(ROOT), shell)

    def capture(self, name: str) -> str:
        return self._run("capture-pane", "-p", "-t", name)

    def send(self, name: str, *keys: str) -> None:
        self._run("send-keys", "-t", name, *keys)

    def resize(self, name: str, width: int, height: int) -> None:
        self._run("resize-window", "-t", name, "-x", str(width), "-y", str(height))

    def wait_for(self, name: str, *texts: str, timeout: float = 30.0) -> str:
        return wait_until(lambda: (lambda s: s if all(t in s for t in texts) else None)(self.capture(name)),
                          timeout=timeout, what=f"{texts} on the terminal")

    def close(self) -> None:
        subprocess.run([self.binary, "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def tmux() -> Iterator[Tmux]:
    t = Tmux()
    yield t
    t.close()


def _top_command(url: str, *extra: str) -> str:
    return " ".join([sys.executable, "-m", "gpu_energy_exporter", "top", "--url", url, "--interval", "300ms", *extra])


@pytest.fixture
def fake_exporter(start_exporter: type[ExporterProcess], fake_nvml_lib: Path, tmp_path: Path) -> ExporterProcess:
    path = tmp_path / "scenario.ini"
    Scenario(epoch=time.time() - 5, gpus=[h100(0, power=Constant(350.0)), h100(1, power=Constant(90.0))]).write(path)
    return start_exporter([f"--nvml.library={fake_nvml_lib}", *FAST],
                          {"FAKE_NVML_SCENARIO": str(path)}).wait_ready()


def _push_run(exp: ExporterProcess, run_id: str) -> TrainingRun:
    gpu0 = h100(0).uuid
    run = start_run(run_id=run_id, model="tiny-llama", backend="eager", gpu_uuids=[gpu0], total_steps=1000,
                    endpoint=exp.otlp_url, export_interval=0.3, rank=0, world_size=1)
    for _ in range(20):
        run.step(tokens=2048, samples=4, loss=2.5, lr=1e-4, duration_s=0.05)
    assert run.flush()
    return run


def test_top_in_a_terminal_shows_gpus_and_the_run_resizes_and_quits_on_q(
    tmux: Tmux, fake_exporter: ExporterProcess
) -> None:
    run = _push_run(fake_exporter, "tmux-run-1")
    try:
        tmux.start("top", _top_command(fake_exporter.metrics_url))
        screen = tmux.wait_for("top", "GPUs (2)", "350/700 W", "90/700 W", "tmux-run-1", "TRAINING RUNS (1 active)")
        assert "H100 80GB HBM3" in screen, screen
        assert "tiny-llama · eager" in screen
        assert "20/1,000" in screen  # steps of the planned total: the ETA's basis
        assert "HOST" in screen and "GiB available" in screen
        assert "SIMULATED" not in screen  # the fake NVML library is the production code path, not the demo

        def run_row() -> str | None:
            row = next((line for line in tmux.capture("top").splitlines() if line.startswith("tmux-run-1")), "")
            return row if row.split()[-1:] == ["g"] else None  # CO2 so far, once a snapshot counted energy

        row = wait_until(run_row, timeout=15, what="the run's CO2 so far")
        assert "2.500" in row  # loss
        # Live: a new step shows up without a key press.
        for _ in range(30):
            run.step(tokens=2048, samples=4, loss=1.25, duration_s=0.05)
        assert run.flush()
        tmux.wait_for("top", "50/1,000", "1.250")

        tmux.resize("top", 80, 24)

        def redrawn() -> str | None:
            first = tmux.capture("top").splitlines()[0].rstrip()
            return first if first.endswith("q: quit") and len(first) <= 80 else None

        wait_until(redrawn, timeout=15, what="the header redrawn for 80 columns")
        assert "GPUs (2)" in tmux.capture("top")

        tmux.send("top", "q")
        after = tmux.wait_for("top", "TOP-EXITED rc=0", timeout=15)
        assert "GPUs (2)" not in after  # the alternate screen is gone: the terminal is restored
    finally:
        run.finish()


def test_top_exits_cleanly_on_ctrl_c(tmux: Tmux, fake_exporter: ExporterProcess) -> None:
    tmux.start("top", _top_command(fake_exporter.metrics_url))
    tmux.wait_for("top", "GPUs (2)")
    tmux.send("top", "C-c")
    after = tmux.wait_for("top", "TOP-EXITED rc=0", timeout=15)
    assert "Traceback" not in after and "GPUs (2)" not in after


def test_top_in_a_terminal_keeps_retrying_an_unreachable_exporter(tmux: Tmux) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    tmux.start("top", _top_command(url))
    tmux.wait_for("top", "nothing listens at " + url, "is the exporter running?")
    wait_until(lambda: "attempt 3" in tmux.capture("top") or "attempt 4" in tmux.capture("top"),
               timeout=15, what="retries")
    tmux.send("top", "q")
    tmux.wait_for("top", "TOP-EXITED rc=0", timeout=15)


# ----------------------------------------------------------------------------------------------------
# without a terminal


def test_once_against_a_dead_exporter_says_why_and_does_not_promise_a_retry() -> None:
    # Issue 12: `top --once` printed "retrying every 1s", then exited 1.
    url = f"http://127.0.0.1:{free_port()}"
    out = io.StringIO()
    rc = top.main(["--once", "--url", url], stdout=out)
    text = out.getvalue()
    assert rc == 1
    assert f"nothing listens at {url} (connection refused): is the exporter running?" in text
    assert "retrying" not in text and "attempt" not in text


def test_plain_text_frames_when_stdout_is_a_pipe_and_sigterm_ends_it(fake_exporter: ExporterProcess) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gpu_energy_exporter", "top", "--url", fake_exporter.metrics_url,
                             "--interval", "200ms"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    frames = 0
    deadline = time.monotonic() + 30
    for line in proc.stdout:
        assert "\x1b[" not in line  # no terminal escapes in a pipe
        if line.startswith(" gpu-energy-exporter top"):
            frames += 1
        if frames >= 3 or time.monotonic() > deadline:
            break
    assert frames >= 3
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    proc.stdout.close()
    assert proc.stderr.read() == ""
    proc.stderr.close()


def test_once_prints_one_frame_and_reports_unreachable_with_exit_1(fake_exporter: ExporterProcess) -> None:
    out = io.StringIO()
    assert top.main(["--url", fake_exporter.metrics_url, "--once", "--ascii"], stdout=out) == 0
    text = out.getvalue()
    assert text.count("gpu-energy-exporter top") == 1
    assert "GPUs (2)" in text and "350/700 W" in text and "[#" in text
    assert text.isascii()  # LANG=C over SSH: nothing the terminal cannot print
    assert "no training run has pushed to this exporter yet" in text

    out = io.StringIO()
    assert top.main(["--url", f"http://127.0.0.1:{free_port()}", "--once"], stdout=out) == 1
    assert "is the exporter running? start it (gpu-energy-exporter, or gpu-energy-exporter demo)" in out.getvalue()

    err = io.StringIO()
    assert top.main(["--interval", "10ms", "--once"], stdout=io.StringIO(), stderr=err) == 2
    assert "at least 100ms" in err.getvalue()


# ----------------------------------------------------------------------------------------------------
# basic auth, TLS, the host RAM warning (an in-process exporter on simulated GPUs)


def _sim_exporter(args: list[str]) -> Exporter:
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=",  # the suite never binds the default 4317
                          "--collector.interval=200ms", *args], {})
    exporter = Exporter(config, backend_factory=lambda: SimulatedBackend(2))
    exporter.start()
    return exporter


def test_basic_auth_and_tls(tmp_path: Path) -> None:
    ca = issue(tmp_path, "ca", ca=True)
    server = issue(tmp_path, "server", issuer=ca, sans=(x509.IPAddress(ipaddress.ip_address("127.0.0.1")),))
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(f"tls_server_config:\n  cert_file: {server.cert_path}\n  key_file: {server.key_path}\n"
                   f"basic_auth_users:\n  ops: {hashed}\n")
    pw = tmp_path / "pw"
    pw.write_text("s3cret\n")
    exporter = _sim_exporter([f"--web.config.file={web}"])
    try:
        assert exporter.web is not None
        url = exporter.web.url
        assert url.startswith("https://")

        def once(*args: str) -> tuple[int, str]:
            out = io.StringIO()
            return top.main(["--once", "--url", url, *args], stdout=out), out.getvalue()

        rc, text = once("--ca-file", str(ca.cert_path), "--user", "ops", "--password-file", str(pw))
        assert rc == 0 and "GPUs (2)" in text and "SIMULATED DATA" in text
        rc, text = once("--ca-file", str(ca.cert_path))
        assert rc == 1 and "401" in text and "--user and --password-file" in text
        # one cause per message (issue 12): a 401 is about credentials, not about a stopped exporter
        assert "running" not in text and "retrying" not in text
        bad = tmp_path / "bad-pw"
        bad.write_text("wrong\n")
        rc, text = once("--ca-file", str(ca.cert_path), "--user", "ops", "--password-file", str(bad))
        assert rc == 1 and "refused the credentials" in text and "running" not in text
        rc, text = once("--user", "ops", "--password-file", str(pw))
        assert rc == 1 and "cannot verify the TLS certificate" in text and "--ca-file" in text
        assert "running" not in text
        rc, text = once("--insecure", "--user", "ops", "--password-file", str(pw))
        assert rc == 0 and "GPUs (2)" in text
        host_port = url.removeprefix("https://")
        rc, text = once("--ca-file", str(ca.cert_path), "--url", f"https://ops:s3cret@{host_port}")
        assert rc == 0 and "GPUs (2)" in text
    finally:
        exporter.stop()


def test_host_ram_below_the_critical_threshold_is_a_warning() -> None:
    exporter = _sim_exporter([f"--host.memory-critical={1 << 50}"])  # more than any machine has
    try:
        assert exporter.web is not None
        out = io.StringIO()
        assert top.main(["--once", "--url", exporter.web.url], stdout=out) == 0
        text = out.getvalue()
        assert "WARNING: host RAM available" in text and "below the critical threshold" in text
    finally:
        exporter.stop()


def test_when_the_exporter_goes_away_the_last_figures_are_greyed_out_and_dated() -> None:
    # Issue 31 item 5: the last frame's "now 1,017 W" stayed under the "nothing listens" banner, undated.
    exporter = _sim_exporter([])
    assert exporter.web is not None
    url = exporter.web.url
    poller = top.Poller(ExporterClient(url), interval=1.0)
    try:
        poller.fetch_once()
        live = poller.view()
        assert live.status is not None and live.error is None
    finally:
        exporter.stop()
    poller.fetch_once()  # the exporter is gone: connection refused
    view = poller.view()
    assert view.error is not None and "nothing listens" in view.error and view.status is not None
    assert view.fetched_at is not None
    fresh = top.render_frame(live, url=url, interval=1.0, width=120, clock=lambda: live.fetched_at or 0.0)
    stale = top.render_frame(view, url=url, interval=1.0, width=120, clock=lambda: view.fetched_at + 12.4)
    fresh_text, stale_text = top.frame_text(fresh), top.frame_text(stale)
    assert "GPUs (2)   now " in fresh_text and "STALE" not in fresh_text
    assert "now " not in stale_text.split("GPUs (2)", 1)[1].splitlines()[0]
    assert "GPUs (2)   12s ago " in stale_text, stale_text
    assert "STALE: the figures below are the last answer, 12s old (greyed out)" in stale_text
    assert "TRAINING RUNS (0 active)   as of 12s ago" in stale_text
    # every figure under the banner is drawn dim (grey); the banner and the SIMULATED mark are not
    banner = next(i for i, line in enumerate(stale) if any(text.startswith("  STALE") for text, _ in line))
    assert stale[banner - 1][0] == (f"! {view.error}", "bad")
    body = [style for line in stale[banner + 1:] for text, style in line if text and "SIMULATED" not in text]
    assert body and set(body) == {"dim"}, set(body)
    assert any(style == "sim" for line in stale for _, style in line)
    assert {style for line in fresh for text, style in line if text} - {"dim"}, "a live frame is not all grey"


def test_the_age_of_stale_figures() -> None:
    assert [top.fmt_age(s) for s in (0.2, 12.4, 59.6, 185, 7620)] == ["0s", "12s", "1m00s", "3m05s", "2h07m"]


# ----------------------------------------------------------------------------------------------------
# pure helpers


def test_eta_from_planned_steps_and_pace() -> None:
    assert top.eta_seconds({"total_steps": 100.0, "steps": 25.0, "duration_s": 50.0}) == pytest.approx(150.0)
    # the trainer's own mean step time wins over elapsed / steps (which includes start-up)
    assert top.eta_seconds({"total_steps": 100.0, "steps": 25.0, "duration_s": 50.0, "mean_step_s": 1.0}) == 75.0
    assert top.eta_seconds({"total_steps": None, "steps": 25.0, "duration_s": 50.0}) is None
    assert top.eta_seconds({"total_steps": 10.0, "steps": 12.0, "duration_s": 5.0}) == 0.0
    assert top.eta_seconds({"total_steps": 10.0, "steps": 0.0, "duration_s": 5.0}) is None


def test_formatting() -> None:
    assert top.bar(0.5, 10) == "[█████·····]"
    assert top.bar(1.7, 4, unicode=False) == "[####]"
    assert top.bar(None, 3) == "[ ? ]"
    # one unit in the whole view (issue 12: header in kWh, rows in kJ)
    assert top.fmt_energy(850) == "0.0002 kWh" and top.fmt_energy(12_345) == "0.0034 kWh"
    assert top.fmt_energy(7.2e6) == "2.000 kWh" and top.fmt_energy(3.6e8) == "100.0 kWh"
    assert fmt.fmt_co2(4.183) == "4.18 g" and fmt.fmt_co2(1234) == "1.23 kg"
    assert fmt.fmt_duration(3725) == "1:02:05" and fmt.fmt_duration(None) == "-"


def test_runs_without_a_terminal_do_not_need_curses_or_a_tty() -> None:
    # Importing `top` or `report` (the sub-commands load them) must not import curses.
    code = ("import sys, gpu_energy_exporter.client.top, gpu_energy_exporter.client.report; "
            "print('curses' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "False", out.stderr
