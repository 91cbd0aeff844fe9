"""Issue 12, "the first hour": what a new user meets in the README's order, and the messages that must point
at the real cause. The slow end-to-end walk through a fresh install is tests/test_first_five_minutes.py."""

from __future__ import annotations

import io
import logging
import socket
import subprocess
import sys

import pytest
from helpers import ROOT

from gpu_energy_exporter.core.errors import ConfigError
from gpu_energy_exporter.daemon.config import load_config
from gpu_energy_exporter.daemon.exporter import Exporter
from gpu_energy_exporter.devices.simulated import SimulatedBackend
from gpu_energy_exporter.http.listen import listen_text
from gpu_energy_exporter.tools import demo


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gpu_energy_exporter", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# -- flags ----------------------------------------------------------------------------------------------


def test_abbreviated_exporter_flag_is_refused_not_taken_for_another() -> None:
    # `--web.listen=…` was taken as --web.listen-address, overriding the explicit flag before it.
    with pytest.raises(ConfigError, match="unrecognized arguments: --web.listen=127.0.0.1:1"):
        load_config(["--web.listen-address=127.0.0.1:0", "--web.listen=127.0.0.1:1"], {})
    out = _cli("--collector.int=1s")
    assert out.returncode == 2 and "unrecognized arguments: --collector.int=1s" in out.stderr


@pytest.mark.parametrize("sub", ["demo", "top", "runs", "report"])
def test_subcommands_refuse_abbreviated_flags(sub: str) -> None:
    flag = {"demo": "--demo.gpu=2", "top": "--inter=1s", "runs": "--group=backend", "report": "--prom=x"}[sub]
    out = _cli(sub, flag, *(["run-1"] if sub == "report" else []))
    assert out.returncode == 2 and f"unrecognized arguments: {flag}" in out.stderr, out.stderr


def test_bare_number_duration_is_refused_naming_the_flag_and_an_example() -> None:
    out = _cli("--collector.interval=5")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "invalid value '5' for --collector.interval" in lines[0] and "5s" in lines[0]
    with pytest.raises(ConfigError, match=r"GPU_ENERGY_EXPORTER_RUNS_WARMUP: needs a unit.*30s"):
        load_config([], {"GPU_ENERGY_EXPORTER_RUNS_WARMUP": "30"})
    err = io.StringIO()
    sys_stderr, sys.stderr = sys.stderr, err
    try:
        assert demo.main(["--demo.run-duration=60"], install_signals=False) == 2
    finally:
        sys.stderr = sys_stderr
    assert "--demo.run-duration" in err.getvalue() and "60s" in err.getvalue()


# -- start-up lines and ports -----------------------------------------------------------------------------


def test_listening_line_says_all_interfaces_for_a_wildcard_address() -> None:
    # The log said `listening on http://[::1]:9863` while the socket listened on every interface.
    text = listen_text("::", 9863, "http://[::1]:9863", True)
    assert text.startswith(":9863 on all interfaces (IPv4 and IPv6;")
    assert listen_text("0.0.0.0", 80, "http://127.0.0.1:80", False).startswith(":80 on all interfaces (IPv4 only")
    assert listen_text("127.0.0.1", 80, "http://127.0.0.1:80", False) == "http://127.0.0.1:80"


def _exporter(args: list[str]) -> Exporter:
    config = load_config(["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                          "--otlp.grpc.listen-address=",  # the suite never binds the default 4317
                          "--no-collector.rapl", *args], {})
    return Exporter(config, backend_factory=lambda: SimulatedBackend(1))


def test_bearer_token_start_up_line_says_bearer_not_basic_auth(tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    exporter = _exporter([f"--otlp.bearer-token-file={token}"])
    with caplog.at_level(logging.INFO, logger="gpu_energy_exporter"):
        exporter.start()
        exporter.stop()
    lines = [r.getMessage() for r in caplog.records if "listening on" in r.getMessage()]
    otlp = [line for line in lines if line.startswith("otlp ")]
    assert len(otlp) == 1 and "(TLS off, bearer token on, at most" in otlp[0], lines
    assert "basic auth" not in otlp[0]
    web = [line for line in lines if line.startswith("gpu-energy-exporter ")]
    assert len(web) == 1 and "(TLS off, basic auth off, at most" in web[0], lines


def test_taken_otlp_port_names_the_flag_and_nothing_is_announced_first(caplog) -> None:  # type: ignore[no-untyped-def]
    # The daemon logged "listening on" the metrics port, then exited on the OTLP port, without naming the flag.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        exporter = _exporter([f"--otlp.listen-address=127.0.0.1:{port}"])
        with caplog.at_level(logging.INFO), pytest.raises(ConfigError) as info:
            exporter.start()
        exporter.stop()
        message = str(info.value)
        assert message.startswith(f"--otlp.listen-address: cannot listen on 127.0.0.1:{port}")
        assert "choose a free port with --otlp.listen-address" in message
        assert not [r for r in caplog.records if "listening on" in r.getMessage()]

        out = _cli("--no-collector.gpu", "--web.listen-address=127.0.0.1:0", f"--otlp.listen-address=127.0.0.1:{port}")
        assert out.returncode == 1
        assert "listening on" not in out.stderr
        assert "--otlp.listen-address: cannot listen on" in out.stderr and "Traceback" not in out.stderr

        out = _cli("--no-collector.gpu", f"--web.listen-address=127.0.0.1:{port}")
        assert out.returncode == 1 and "--web.listen-address: cannot listen on" in out.stderr


# -- the demo -------------------------------------------------------------------------------------------


def test_simulated_power_samples_bracket_the_energy_counters_average() -> None:
    # The demo's runs showed an average power above their peak: the instant power the exporter samples once a
    # second aliased with the simulated 80 ms steps and stayed below the energy counter's average. The ledger
    # sees one phase of its sampler against the trace: every phase must give peak > average.
    for k in range(20):
        t = [1000.0 + k * 0.004]  # phases over one 80 ms step
        backend = SimulatedBackend(2, clock=lambda t=t: t[0])  # type: ignore[misc]
        gpus = backend.devices()
        for i in range(2):
            backend.set_load(i, 0.86, 1)
        t0 = t[0]
        start = [backend.read(g).energy_j for g in gpus]
        peak = 0.0
        for _ in range(30):  # a 30 s run sampled every second
            t[0] += 1.0
            peak = max(peak, sum(backend.read(g).power_instant_w or 0.0 for g in gpus))
        end = [backend.read(g).energy_j for g in gpus]
        avg = sum((e or 0.0) - (s or 0.0) for s, e in zip(start, end, strict=True)) / (t[0] - t0)
        assert avg < peak <= 2 * 700.0, (k, avg, peak)


def test_demo_without_the_training_helper_says_what_to_install() -> None:
    # `make run ARGS=demo` after `make run` died with ModuleNotFoundError printed as one log line with \n escapes.
    # sys.modules[name] = None is Python's own way to make a package unimportable (the import system raises
    # ModuleNotFoundError for it), as in an environment where it was never installed.
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.exporter'] = None\n"
        "from gpu_energy_exporter.daemon.cli import main\n"
        "sys.exit(main(['demo', '--web.listen-address=127.0.0.1:0', '--otlp.listen-address=127.0.0.1:0']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "opentelemetry.exporter" in lines[0]
    assert "pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http" in lines[0]
    assert "Traceback" not in out.stderr and "\\n" not in out.stderr


def test_a_failing_simulated_trainer_is_one_readable_log_line() -> None:
    # The trainer's ModuleNotFoundError was logged as one logfmt line with the traceback as \n escapes. The
    # demo now checks before it starts (above); a trainer that fails anyway says why in one line, the
    # traceback only at --log.level=debug.
    code = (
        "import sys\n"
        "sys.modules['opentelemetry.exporter'] = None\n"
        "from gpu_energy_exporter.tools.demo import SimulatedTrainer\n"
        "from gpu_energy_exporter.devices.simulated import SimulatedBackend\n"
        "from gpu_energy_exporter.daemon.logsetup import setup_logging\n"
        "setup_logging(sys.argv[1])\n"
        "b = SimulatedBackend(1)\n"
        "t = SimulatedTrainer(b, [g.uuid for g in b.devices()], 'http://127.0.0.1:9', pause=0, runs=1).start()\n"
        "assert t.done.wait(30)\n"
        "print(t.error)\n"
    )
    for level in ("info", "debug"):
        out = subprocess.run([sys.executable, "-c", code, level], capture_output=True, text=True, timeout=60,
                             cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert "opentelemetry.exporter" in out.stdout
        errors = [line for line in out.stderr.splitlines() if "level=error" in line]
        assert len(errors) == 1 and "the simulated trainer stopped (ImportError:" in errors[0]
        assert "\\n" not in errors[0] and "Traceback" not in errors[0]
        assert ("Traceback" in out.stderr) == (level == "debug")
