"""Shared fixtures: the fake NVML library, an exporter subprocess, a real Prometheus server.

Everything here starts real processes on 127.0.0.1 with ephemeral ports and stops them at the end of the
test; nothing is mocked.
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
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

from fakenvml import build_library  # noqa: E402
from freshinstall import fresh_install  # noqa: E402, F401 - a session fixture shared by two test files


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1, compiled once per session with the system C compiler."""
    return build_library(tmp_path_factory.mktemp("fakenvml"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_LISTEN_RE = re.compile(r"(gpu-energy-exporter|otlp) listening on (https?://[^ ]+)")


class ExporterProcess:
    """``python -m gpu_energy_exporter`` as a child process; URLs are read from its log."""

    def __init__(self, args: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None,
                 subcommand: Sequence[str] = ()) -> None:
        full_env = dict(os.environ)
        full_env.pop("FAKE_NVML_SCENARIO", None)
        full_env.update(env or {})
        full_env["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, "-m", "gpu_energy_exporter", *subcommand,
               "--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=full_env, cwd=cwd)
        self.lines: list[str] = []
        self.urls: dict[str, str] = {}
        self._got_urls = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            m = _LISTEN_RE.search(line)
            if m:
                self.urls[m.group(1)] = m.group(2)
                if len(self.urls) == 2:
                    self._got_urls.set()
        self._got_urls.set()

    def wait_ready(self, timeout: float = 30.0) -> ExporterProcess:
        if not self._got_urls.wait(timeout) or len(self.urls) < 2:
            self.stop()
            raise AssertionError("exporter did not start:\n" + self.log())
        return self

    @property
    def metrics_url(self) -> str:
        return self.urls["gpu-energy-exporter"]

    @property
    def otlp_url(self) -> str:
        return self.urls["otlp"]

    def get(self, path: str = "/metrics", headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
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

    def log(self) -> str:
        return "\n".join(self.lines)

    def stop(self, timeout: float = 15.0) -> int:
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


@pytest.fixture
def start_exporter() -> Iterator[type[ExporterProcess]]:
    started: list[ExporterProcess] = []

    class _Tracked(ExporterProcess):
        def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*a, **kw)
            started.append(self)

    yield _Tracked
    for p in started:
        p.stop()


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample ``name{labels...}`` in exposition text (labels may be a subset)."""
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            return float(m.group(4))
    return None


def require_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (the README test command installs Debian's prometheus)")
    return path


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.2, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")
