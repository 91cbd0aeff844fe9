"""Plain helpers shared by the tests and the benchmarks: free ports, bounded waits, reading exposition text,
a registry around collector output, and child processes (the exporter among them).

pytest fixtures live in conftest.py; this module holds plain functions and classes so that ``bench/``
can import them too (bench/__init__.py puts ``tests/`` on ``sys.path``, as it does for ``fakenvml``).
It must never import pytest or the package at module level (the benchmarks import it, pytest or not)
and never mocks anything: every process it starts is real, listens on 127.0.0.1 only, and is stopped
by ``stop()`` or the ``with`` block.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------------
# ports and waits


def free_port() -> int:
    """A loopback port that was free a moment ago (bound, then released): listen on it, or connect to it
    and be refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def poll(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.2) -> T | None:
    """``predicate()`` every ``interval`` s until it returns something true (returned), or ``None`` after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval)


def wait_until(predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.2,
               what: str = "condition") -> T:
    """Like ``poll``, but an AssertionError naming ``what`` (and the last answer) when time runs out."""
    last: list[object] = [None]

    def remembered() -> T:
        got = predicate()
        last[0] = got
        return got

    got = poll(remembered, timeout, interval)
    if not got:
        raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last[0]!r})")
    return got


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 (False on any other status or a connection error)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def require_binary(name: str) -> str:
    """The path of ``name`` on PATH; skips the calling test when it is not installed."""
    path = shutil.which(name)
    if path is None:
        import pytest

        pytest.skip(f"{name} is not installed (the README test command installs Debian's prometheus)")
    return path


# ----------------------------------------------------------------------------------------------------
# exposition text and collector output

_SAMPLE_VALUE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text: str, name: str) -> Iterable[tuple[dict[str, str], float]]:
    """``(labels, value)`` of every sample of ``name`` in exposition text (label values left escaped)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = _SAMPLE_VALUE.match(line)
        if m and m.group(1) == name:
            yield dict(_LABEL.findall(m.group(3) or "")), float(m.group(4))


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name{labels...}`` in exposition text (labels may be a subset)."""
    for got, value in samples(text, name):
        if all(got.get(k) == v for k, v in labels.items()):
            return value
    return None


class _Families:
    """The one method a registry asks of a collector: hands back fixed families."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def registry_of(families: list[Metric]) -> CollectorRegistry:
    """A registry holding exactly ``families`` (a collector's ``update()``), for ``get_sample_value`` and the
    encoders."""
    reg = CollectorRegistry()
    reg.register(_Families(families))
    return reg


class GPURig:
    """The GPU collector on ``backend_factory``, its sampler and the exposition registry, in one process:
    ``sample()`` takes snapshots, ``value()`` and ``text()`` read what /metrics would serve. ``close()``
    shuts the backend down. (The package is imported here, not at the top: bench imports this module.)"""

    def __init__(self, backend_factory: Callable[[], Any], **kw: Any) -> None:
        from gpu_energy_exporter.collectors.gpu import GPUCollector
        from gpu_energy_exporter.engine.exposition import SnapshotCollector, new_registry
        from gpu_energy_exporter.engine.sampler import Sampler

        self.collector = GPUCollector(backend_factory, retry_interval=0.0, **kw)
        self.sampler = Sampler([self.collector], 1.0, gpu_states=self.collector.states)
        self.registry = new_registry(SnapshotCollector(self.sampler))

    def sample(self, n: int = 1) -> None:
        for _ in range(n):
            self.sampler.sample_once()

    def value(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def text(self) -> str:
        return generate_latest(self.registry).decode()

    def close(self) -> None:
        self.collector.close()


#: Families whose values depend on time, the machine or the process, not on the scenario (whole-exporter goldens).
VOLATILE = ("gpuenergy_collector_duration_seconds", "gpuenergy_snapshot_timestamp_seconds",
            "gpuenergy_gpu_last_sample_age_seconds", "gpuenergy_process_",
            "gpuenergy_otlp_request_duration_seconds_total", "gpuenergy_health_last_read_",
            "gpuenergy_nvml_calls_total", "gpuenergy_nvml_call_seconds_total")
SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)( \S+)?$")
_GPU_LABEL = re.compile(r'[{,]gpu="([^"]*)"')


def normalise(text: str, integrating: Iterable[str] = (), volatile: Sequence[str] = VOLATILE) -> str:
    """Served exposition text with what changes from run to run masked, for a golden file: the value of
    every family in ``volatile`` (prefixes), every sample timestamp, the Python version in build_info, and
    the energy of the GPUs in ``integrating`` (gpu label values), integrated over wall-clock time. Comment
    lines (HELP, TYPE, UNIT, EOF), names, labels and every other value stay as served."""
    integrating = set(integrating)
    lines = []
    for line in text.splitlines():
        m = SAMPLE_LINE.match(line)
        if m is None or line.startswith("#"):
            lines.append(line)
            continue
        name, labels, value, stamp = m.group(1), m.group(2) or "", m.group(3), m.group(4)
        if name == "gpuenergy_build_info":
            labels = re.sub(r'python_version="[^"]*"', 'python_version="<masked>"', labels)
        if name.startswith(tuple(volatile)):
            value = "<masked>"
        gpu = _GPU_LABEL.search(labels)
        # The CO2 counter prices that energy: it moves with it.
        if name in ("gpuenergy_gpu_energy_joules_total", "gpuenergy_gpu_co2_grams_total") and gpu \
                and gpu.group(1) in integrating:
            value = "<integrated over wall time>"
        lines.append(f"{name}{labels} {value}" + (" <timestamp>" if stamp else ""))
    return "\n".join(lines) + "\n"


def check_golden(got: str, golden: Path) -> None:
    """``got`` equals the reviewed file ``golden``; with ``UPDATE_GOLDEN=1`` in the environment it is written
    there first (review the diff before committing it)."""
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
    assert golden.exists(), f"no golden file {golden}: run with UPDATE_GOLDEN=1 and review it"
    want = golden.read_text()
    if got != want:
        import difflib

        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(golden), "got", n=1))
        raise AssertionError(f"the output differs from {golden}; if intended, UPDATE_GOLDEN=1 and review:\n"
                             + diff[:6000])


# ----------------------------------------------------------------------------------------------------
# child processes


class Child:
    """A child process whose stdout and stderr are drained by a thread into ``lines`` (the last 10,000
    kept, so that a long benchmark does not grow without end); ``stop()`` sends SIGTERM, then SIGKILL.

    The child's environment is ``environ`` (default: this process's) with ``env`` on top;
    ``FAKE_NVML_SCENARIO`` of ``environ`` is dropped (a child gets a scenario only when ``env`` names one)
    and ``PYTHONUNBUFFERED`` is set so that log lines arrive as they are written.
    ``new_session``: the child gets its own session, so a Ctrl-C in the terminal reaches only the caller
    (which then stops it in order)."""

    MAX_LINES = 10_000

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 name: str = "", on_line: Callable[[str], None] | None = None, new_session: bool = False,
                 environ: Mapping[str, str] | None = None) -> None:
        full_env = dict(os.environ if environ is None else environ)
        full_env.pop("FAKE_NVML_SCENARIO", None)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        self.name = name or Path(cmd[0]).name
        self.cmd = list(cmd)
        self.lines: list[str] = []
        self._on_line = on_line
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, cwd=cwd or ROOT, start_new_session=new_session)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"read-{self.name}")
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if len(self.lines) > self.MAX_LINES:
                del self.lines[: self.MAX_LINES // 2]
            if self._on_line is not None:
                self._on_line(line)
        self._eof()

    def _eof(self) -> None:
        """Called on the reader thread once the child closed its output."""

    def log(self, last: int | None = None) -> str:
        """The output so far (its ``last`` lines when given)."""
        return "\n".join(self.lines if last is None else self.lines[-last:])

    def wait_for(self, needle: str, timeout: float = 30.0) -> str:
        """The first output line containing ``needle``; AssertionError with the output when the child
        ended without one or ``timeout`` s passed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if needle in line:
                    return line
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: no output line with {needle!r} within {timeout:g}s:\n{self.log()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout`` s; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return int(self.proc.returncode)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


_LISTEN_RE = re.compile(r"(gpu-energy-exporter|otlp|otlp-grpc) listening on (https?://[^ \"]+)")


class ExporterProcess(Child):
    """``python -m gpu_energy_exporter [subcommand] --web.listen-address=127.0.0.1:0
    --otlp.listen-address=127.0.0.1:0 ARGS`` as a child process; its two URLs are read from its log.

    ``command`` replaces ``python -m gpu_energy_exporter`` (an installed console script; the benchmarks'
    profiler ``python -m bench.profiled DIR gpu_energy_exporter``). ``wait_ready()`` (or entering a
    ``with`` block) waits until both servers listen; ``metrics_url`` and ``otlp_url`` are the servers'
    base URLs, ``scrape_url`` and ``push_url`` the endpoints a scraper and a trainer use."""

    def __init__(self, args: Sequence[str] = (), env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 subcommand: Sequence[str] = (), command: Sequence[str] | None = None,
                 new_session: bool = False, environ: Mapping[str, str] | None = None) -> None:
        self.urls: dict[str, str] = {}
        self._ready = threading.Event()
        cmd = [*(command or (sys.executable, "-m", "gpu_energy_exporter")), *subcommand,
               "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
               # OTLP/gRPC off unless a test turns it on (ARGS come later and win): a port and a loaded
               # grpc per exporter only where a test uses them
               "--otlp.grpc.listen-address=", *args]
        super().__init__(cmd, env=env, cwd=cwd, name="gpu-energy-exporter", on_line=self._line,
                         new_session=new_session, environ=environ)

    def _line(self, line: str) -> None:
        m = _LISTEN_RE.search(line)
        if m:
            self.urls[m.group(1)] = m.group(2)
            # gRPC, when on, is announced first (daemon.exporter): both HTTP servers mean every port is up
            if "gpu-energy-exporter" in self.urls and "otlp" in self.urls:
                self._ready.set()

    def _eof(self) -> None:
        self._ready.set()

    def wait_ready(self, timeout: float = 60.0) -> ExporterProcess:
        """Both servers listen; otherwise (exited, or ``timeout`` s passed) stopped, and AssertionError with
        its log."""
        if not self._ready.wait(timeout) or len(self.urls) < 2:
            self.stop()
            raise AssertionError("the exporter did not start:\n" + self.log())
        return self

    @property
    def metrics_url(self) -> str:
        """Base URL of the metrics server (``/metrics``, ``/api/v1/...`` below it)."""
        return self.urls["gpu-energy-exporter"]

    @property
    def otlp_url(self) -> str:
        """Base URL of the OTLP receiver (what the training helper's ``endpoint`` takes)."""
        return self.urls["otlp"]

    @property
    def grpc_endpoint(self) -> str:
        """The OTLP/gRPC receiver's endpoint (``http://host:port``), when a test turned it on."""
        return self.urls["otlp-grpc"]

    @property
    def scrape_url(self) -> str:
        return self.metrics_url + "/metrics"

    @property
    def push_url(self) -> str:
        return self.otlp_url + "/v1/metrics"

    def address(self, which: str = "gpu-energy-exporter") -> tuple[str, int]:
        """(host, port) of one server: ``gpu-energy-exporter`` or ``otlp``."""
        host, port = self.urls[which].split("//", 1)[1].rsplit(":", 1)
        return host, int(port)

    def get(self, path: str = "/metrics", headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
        """(status, decoded body, headers) of a GET on the metrics server."""
        req = urllib.request.Request(self.metrics_url + path, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read().decode(), dict(resp.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(), dict(exc.headers)

    def metrics(self) -> str:
        status, body, _ = self.get()
        assert status == 200, body
        return body

    def __enter__(self) -> ExporterProcess:
        return self.wait_ready()

