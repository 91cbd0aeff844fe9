"""Shared machinery of the benchmarks: the machine, result tables, the exporter as a child process, the
fake GPUs, OTLP requests shaped like the training helper's, a keep-alive HTTP client and /proc readings.

Every benchmark module has ``TITLE`` and ``run(ctx) -> list[Table]``; ``python -m bench`` runs them all
and ``python -m bench.<module>`` runs one (``main_for``). Figures are printed, never asserted: a slow
machine gives slow figures, not a failure. Everything listens and connects on 127.0.0.1 only, and every
process started here is stopped by the ``with`` block that started it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import http.client
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import fakenvml  # tests/fakenvml (on sys.path by bench/__init__.py): the fake libnvidia-ml.so.1 and its scenarios
from helpers import Child, ExporterProcess, samples

ROOT = Path(__file__).resolve().parent.parent

#: Where peers' virtual environments live (git-ignored; created on demand by ``bench.peer_envs``).
PEER_VENVS = ROOT / ".bench-venvs"


# ----------------------------------------------------------------------------------------------------
# the run context


@dataclass
class Context:
    """What every benchmark gets: the mode, a scratch directory and the fake NVML library."""

    quick: bool
    workdir: Path
    soak_s: float
    peers: bool
    command: str
    soak_stale_after: str = "60s"
    profile: Path | None = None
    #: The fake library's cost model (``fakenvml.COST_PROFILES``, or "off"): every NVML call burns the CPU
    #: that real driver burns for it. On by default: a cost measured on a fake answering in microseconds says
    #: nothing about a real node.
    cost_profile: str = fakenvml.COST_PROFILES[0]
    #: ``--real-driver``: the benchmarks that support it measure the real NVIDIA driver instead of the fake.
    real_driver: bool = False
    _lib: Path | None = None

    @property
    def lib(self) -> Path:
        """The fake libnvidia-ml.so.1, compiled on first use (cached by source hash)."""
        if self._lib is None:
            self._lib = fakenvml.build_library(self.workdir / "fakenvml")
        return self._lib

    def path(self, name: str) -> Path:
        return self.workdir / name

    def pick(self, quick: Any, full: Any) -> Any:
        return quick if self.quick else full


# ----------------------------------------------------------------------------------------------------
# the machine


def machine() -> dict[str, str]:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    mem = ""
    try:
        m = re.search(r"MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text())
        if m:
            mem = f"{int(m.group(1)) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return {
        "cpu": model,
        "cores": f"{usable} usable of {os.cpu_count()}",
        "memory": mem,
        "python": platform.python_version(),
        "kernel": platform.release(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "load": load,
    }


def machine_line() -> str:
    m = machine()
    return (f"machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM, Python {m['python']}, "
            f"Linux {m['kernel']}, {m['date']}, load average {m['load']}")


# ----------------------------------------------------------------------------------------------------
# tables


class Table:
    """A titled table of figures, printed as Markdown (so it can be pasted into docs/benchmarks.md)."""

    def __init__(self, title: str, columns: Sequence[str], notes: Iterable[str] = ()) -> None:
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []
        self.notes = list(notes)

    def add(self, *cells: object) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([c if isinstance(c, str) else fmt(c) for c in cells])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def render(self) -> str:
        widths = [len(c) for c in self.columns]
        for row in self.rows:
            widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
        # a column is right-aligned when every cell in it reads as a number
        right = [i > 0 and bool(self.rows) and all(_numeric(r[i]) or r[i] == "n/a" for r in self.rows)
                 for i in range(len(self.columns))]

        def line(cells: Sequence[str]) -> str:
            out = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
            return "| " + " | ".join(out) + " |"

        rule = "|" + "|".join("-" * (w + 1) + (":" if r else "-") for w, r in zip(widths, right, strict=True)) + "|"
        parts = [f"### {self.title}", "", line(self.columns), rule]
        parts += [line(r) for r in self.rows]
        if self.notes:
            parts.append("")
            parts += [f"- {n}" for n in self.notes]
        return "\n".join(parts) + "\n"


def _numeric(cell: str) -> bool:
    return bool(re.match(r"^[-+~<>]?\s?\d", cell))


def fmt(x: object, digits: int = 3) -> str:
    """A number with about ``digits`` significant digits (no scientific notation for everyday sizes)."""
    if x is None:
        return "n/a"
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x == 0:
        return "0"
    mag = math.floor(math.log10(abs(x)))
    decimals = max(0, digits - 1 - mag)
    return f"{x:,.{decimals}f}"


def pct(x: float | None, digits: int = 2, signed: bool = False) -> str:
    if x is None or math.isnan(x):
        return "n/a"
    return f"{x * 100:+.{digits}f}%" if signed else f"{x * 100:.{digits}f}%"


# ----------------------------------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ms(seconds: float) -> float:
    return seconds * 1000.0


# ----------------------------------------------------------------------------------------------------
# /proc readings (our own processes and the ones we started)

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def thread_count(pid: int) -> int:
    m = re.search(r"Threads:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) if m else 0


class CPUWindow:
    """CPU share of one process over a wall-clock window: ``with CPUWindow(pid) as w: ...; w.percent``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.percent = float("nan")
        self.cpu_s = 0.0
        self.wall_s = 0.0

    def __enter__(self) -> CPUWindow:
        self._c0, self._t0 = cpu_seconds(self.pid), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu_s = cpu_seconds(self.pid) - self._c0
        self.wall_s = time.monotonic() - self._t0
        self.percent = 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")


# ----------------------------------------------------------------------------------------------------
# child processes


def exporter(ctx: Context, args: Sequence[str] = (), scenario: Path | None = None,
             env: Mapping[str, str] | None = None, profile: Path | None = None) -> ExporterProcess:
    """The exporter as a child process (tests/helpers.py's wrapper, shared with the tests), on ports 0,
    optionally on the fake NVML library with ``scenario``; ``with`` waits until it listens.

    ``profile``: run it under ``bench.profiled`` (cProfile in every thread), writing there."""
    # bench.profiled takes the module's name alone, then its arguments
    command = None if profile is None else [sys.executable, "-m", "bench.profiled", str(profile), "gpu_energy_exporter"]
    full_env = dict(env or {})
    cmd: list[str] = []
    if scenario is not None:
        cmd += ["--nvml.library", str(ctx.lib)]
        full_env[fakenvml.SCENARIO_ENV] = str(scenario)
        full_env.setdefault(fakenvml.COST_PROFILE_ENV, ctx.cost_profile)
    return ExporterProcess([*cmd, *args], env=full_env, command=command, new_session=True)


def py_spy() -> str | None:
    """The py-spy sampling profiler, when installed (``pip install py-spy``): beside Python, or on PATH."""
    import shutil

    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.exists() else shutil.which("py-spy")


class FlameGraph:
    """``py-spy record`` attached to a running process until the ``with`` block ends: a flame graph SVG.

    ``--nonblocking`` (py-spy does not pause the process to sample it), ``--threads`` (one stack per
    thread), 250 samples a second. Does nothing, and says why in ``error``, when py-spy is missing or
    cannot attach.
    """

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out = pid, out
        self.error = ""
        self._child: Child | None = None

    def __enter__(self) -> FlameGraph:
        exe = py_spy()
        if exe is None:
            self.error = "py-spy is not installed (pip install py-spy): no flame graph"
            return self
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._child = Child([exe, "record", "--pid", str(self.pid), "--nonblocking", "--threads", "--rate", "250",
                             "--format", "flamegraph", "--output", str(self.out)], name="py-spy")
        time.sleep(0.5)
        if not self._child.alive():
            self.error = "py-spy could not attach: " + self._child.log(5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._child is None:
            return
        if self._child.alive():
            self._child.proc.send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
            try:
                self._child.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._child.stop()
        if not self.out.exists() and not self.error:
            self.error = "py-spy wrote nothing: " + self._child.log(5)


# ----------------------------------------------------------------------------------------------------
# HTTP with keep-alive, timed


class HTTPClient:
    """One persistent HTTP/1.1 connection (as Prometheus keeps one per target)."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.path = parts.path or "/"
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None

    def _connection(self) -> http.client.HTTPConnection:
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        return self._conn

    def request(self, method: str = "GET", path: str | None = None, body: bytes | None = None,
                headers: Mapping[str, str] | None = None) -> tuple[int, bytes, float]:
        """(status, body, seconds from sending the request to the last byte of the answer)."""
        for attempt in (0, 1):
            conn = self._connection()
            try:
                t0 = time.perf_counter()
                conn.request(method, path or self.path, body=body, headers=dict(headers or {}))
                resp = conn.getresponse()
                data = resp.read()
                elapsed = time.perf_counter() - t0
                if resp.getheader("Connection", "").lower() == "close":
                    self.close()
                return resp.status, data, elapsed
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()  # the server closed an idle keep-alive connection: reconnect once
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str | None = None, headers: Mapping[str, str] | None = None) -> tuple[int, bytes, float]:
        return self.request("GET", path, headers=headers)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def sample_total(text: str, name: str) -> float:
    """The sum of every sample of ``name`` (whatever its labels) in exposition text."""
    return sum(value for _, value in samples(text, name))


def sample_values(text: str, name: str) -> dict[str, float]:
    """``{gpu label or '': value}`` for every sample of ``name`` in exposition text."""
    return {labels.get("gpu", ""): value for labels, value in samples(text, name)}


# ----------------------------------------------------------------------------------------------------
# fake GPUs


def write_scenario(path: Path, gpus: Sequence[fakenvml.GPU], *, epoch: float | None = None,
                   driver: fakenvml.Driver | None = None) -> fakenvml.Scenario:
    sc = fakenvml.Scenario(epoch=time.time() if epoch is None else epoch, driver=driver or fakenvml.Driver(),
                           gpus=list(gpus))
    sc.write(path)
    return sc


def h100s(n: int, power: fakenvml.PowerTrace | None = None) -> list[fakenvml.GPU]:
    trace = power or fakenvml.Square(120.0, 650.0, 0.06, 0.65)
    return [fakenvml.h100(i, power=trace, util_gpu_pct=87, memory_used_bytes=60 << 30) for i in range(n)]


# ----------------------------------------------------------------------------------------------------
# running benchmarks


def new_parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="gpu-energy-exporter benchmarks (see docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny durations, figures not meaningful")
    p.add_argument("--soak-seconds", type=float, default=None,
                   help="length of the memory soak (default: 300 s; --quick: 6 s)")
    p.add_argument("--soak-stale-after", default=None, metavar="DURATION",
                   help="--runs.stale-after of the soak's exporter (default 60s; --quick: 3s; the exporter's "
                        "own default is 5m, which makes the ledger hold every churned run for 5 minutes)")
    p.add_argument("--no-peers", dest="peers", action="store_false", default=None,
                   help="skip the peers (Zeus, CodeCarbon, nvitop-exporter); --quick skips them anyway")
    p.add_argument("--peers", dest="peers", action="store_true",
                   help="run the peers even with --quick (installs them into .bench-venvs/ first)")
    p.add_argument("--cost-profile", default=fakenvml.COST_PROFILES[0], choices=[*fakenvml.COST_PROFILES, "off"],
                   help="the fake NVML library's cost model: each call burns the CPU that real driver was measured "
                        f"to burn (default {fakenvml.COST_PROFILES[0]}; off: answers in microseconds)")
    p.add_argument("--real-driver", action="store_true",
                   help="exporter_cost: measure the real NVIDIA driver of this machine instead of the fake library "
                        "(fails, saying so, without one)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a temporary one)")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="scrape_latency and otlp_throughput: also run the exporter once under cProfile (every "
                        "thread) and, when py-spy is installed, py-spy; write the profiles and a flame graph "
                        "under DIR and print the top functions (timings taken while profiling mean nothing)")
    return p


def make_context(args: argparse.Namespace, command: str, workdir: Path) -> Context:
    soak = args.soak_seconds if args.soak_seconds is not None else (6.0 if args.quick else 300.0)
    peers = args.peers if args.peers is not None else not args.quick
    stale = args.soak_stale_after or ("3s" if args.quick else "60s")
    profile = args.profile.resolve() if getattr(args, "profile", None) is not None else None
    return Context(quick=args.quick, workdir=workdir, soak_s=soak, peers=peers, command=command,
                   soak_stale_after=stale, profile=profile,
                   cost_profile=getattr(args, "cost_profile", fakenvml.COST_PROFILES[0]),
                   real_driver=getattr(args, "real_driver", False))


class Unavailable(Exception):
    """A benchmark that cannot run here (no GPU for ``--real-driver``): said in one line, not a traceback."""


def require_real_driver() -> None:
    """Raise ``Unavailable`` unless this machine has an NVIDIA driver (``--real-driver``)."""
    if not (Path("/dev/nvidiactl").exists() or Path("/proc/driver/nvidia/version").exists()):
        raise Unavailable("--real-driver needs an NVIDIA GPU and driver: this machine has no /dev/nvidiactl "
                          "(run it on a GPU machine; the fake-library figures need no flag)")


def command_string(module: str, argv: Sequence[str]) -> str:
    return shlex.join(["python", "-m", module, *argv])


def run_benchmark(module: Any, ctx: Context, out: Callable[[str], None] = print) -> bool:
    """Run one benchmark module and print its header and tables. Returns False when it failed."""
    out(f"## {module.TITLE}\n")
    out(f"command: `{ctx.command}`  ")
    out(machine_line() + "  ")
    out("NVML: the real driver of this machine\n" if ctx.real_driver else
         f"NVML: the fake library, cost model {ctx.cost_profile} (--cost-profile)\n")
    started = time.monotonic()
    try:
        tables = module.run(ctx)
    except Unavailable as exc:
        out(f"NOT RUN: {exc}\n")
        return False
    except Exception:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
        out("FAILED:\n```\n" + traceback.format_exc() + "```\n")
        return False
    for table in tables:
        out(table.render())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    out(f"({module.__name__.rsplit('.', 1)[-1]} took {time.monotonic() - started:.0f} s; load average at the end "
        f"{load})\n")
    return True


def main_for(module_name: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m bench.<module>``: run that benchmark alone."""
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    args = new_parser(f"python -m {module_name}").parse_args(argv)
    module = importlib.import_module(module_name)
    with tempfile.TemporaryDirectory(prefix="gee-bench-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        ctx = make_context(args, command_string(module_name, argv), workdir)
        return 0 if run_benchmark(module, ctx) else 1


def every(interval: float, stop: threading.Event, fn: Callable[[], None]) -> None:
    """Call ``fn`` on a fixed schedule until ``stop`` is set (missed ticks are skipped, not bunched)."""
    next_t = time.monotonic()
    while not stop.is_set():
        fn()
        next_t += interval
        delay = next_t - time.monotonic()
        if delay < 0:
            next_t = time.monotonic()
            delay = 0.0
        if stop.wait(delay):
            break
