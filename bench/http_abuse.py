"""How the exporter's two HTTP ports hold up against hostile clients: slow (slowloris) and idle connection
floods, and a chunked body with a chunk size of ``-1`` streamed without end.

``python -m bench.http_abuse [--connections 512] [--seconds 20] [--source DIR]`` starts
``python -m gpu_energy_exporter`` (from ``DIR`` when given, e.g. an older checkout, to compare) on
127.0.0.1 ports 0, opens the connections against *each* port, and meanwhile scrapes ``/metrics``,
``/-/healthy`` and posts an empty OTLP request every 0.5 s with a 2 s timeout. It prints, per attack, how
many of those requests were answered, the slowest answer, the exporter's peak thread count, and for the
chunk ``-1`` attack how much the server took in and its peak RSS.

This module never asserts anything and only talks to the exporter it started on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from helpers import ExporterProcess

ROOT = Path(__file__).resolve().parent.parent


def _status(pid: int, key: str) -> int:
    m = re.search(rf"{key}:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(m.group(1)) if m else 0


def _exporter(source: Path, args: Sequence[str]) -> ExporterProcess:
    """The exporter of the checkout ``source`` (its package on PYTHONPATH, run from there), GPU and RAPL
    collectors off, listening."""
    return ExporterProcess(["--no-collector.gpu", "--no-collector.rapl", *args], env={"PYTHONPATH": str(source)},
                           cwd=source).wait_ready(30)


class Flood:
    """``n`` connections to ``address`` sending ``first`` then one byte of ``trickle`` per second each
    (None: nothing more), reconnecting those the server closes."""

    def __init__(self, address: tuple[str, int], n: int, first: bytes, trickle: bytes | None) -> None:
        self.address, self.first, self.trickle = address, first, trickle
        self.socks: list[socket.socket | None] = [None] * n
        self.stop = threading.Event()
        for i in range(n):
            self._connect(i)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _connect(self, i: int) -> None:
        try:
            s = socket.create_connection(self.address, timeout=1)
            s.setblocking(False)
            if self.first:
                s.send(self.first)
            self.socks[i] = s
        except OSError:
            self.socks[i] = None

    def _loop(self) -> None:
        while not self.stop.wait(1.0):
            for i, s in enumerate(self.socks):
                try:
                    if s is None:
                        self._connect(i)
                    elif self.trickle is not None:
                        s.send(self.trickle)
                except OSError:
                    if s is not None:
                        s.close()
                    self.socks[i] = None

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        for s in self.socks:
            if s is not None:
                s.close()


def _probe(exp: ExporterProcess) -> list[tuple[bool, float]]:
    out = []
    for url, data in ((exp.urls["gpu-energy-exporter"] + "/metrics", None),
                      (exp.urls["gpu-energy-exporter"] + "/-/healthy", None),
                      (exp.urls["otlp"] + "/v1/metrics", b"")):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/x-protobuf"})
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                resp.read()
                ok = resp.status == 200
        except (OSError, urllib.error.HTTPError):
            ok = False
        out.append((ok, time.monotonic() - t0))
    return out


def flood_row(exp: ExporterProcess, n: int, seconds: float, slow: bool) -> tuple[str, ...]:
    floods = []
    for which, first in (("gpu-energy-exporter", b"GET /metrics HTTP/1.1\r\nHost: x\r\n"),
                         ("otlp", b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\n")):
        floods.append(Flood(exp.address(which), n, first if slow else b"", b"X" if slow else None))
    results: list[tuple[bool, float]] = []
    threads = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            results += _probe(exp)
            threads = max(threads, _status(exp.proc.pid, "Threads"))
            time.sleep(0.5)
    finally:
        for f in floods:
            f.close()
    ok = sum(1 for r, _ in results if r)
    slowest = max((d for r, d in results if r), default=float("nan"))
    return (f"{'slow' if slow else 'idle'} x{n} per port, {seconds:g} s", f"{ok}/{len(results)}",
            f"{slowest * 1000:.0f}", str(threads))


def chunk_row(exp: ExporterProcess, seconds: float) -> tuple[str, ...]:
    rss0 = _status(exp.proc.pid, "VmRSS")
    peak = rss0
    sent = 0
    block = b"\0" * (1 << 20)
    t0 = time.monotonic()
    reply = b""
    with socket.create_connection(exp.address("otlp"), timeout=5) as s:
        s.sendall(b"POST /v1/metrics HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-protobuf\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n-1\r\n")
        try:
            while sent < (256 << 20) and time.monotonic() - t0 < seconds:
                s.sendall(block)
                sent += len(block)
                peak = max(peak, _status(exp.proc.pid, "VmRSS"))
        except OSError:
            pass
        s.settimeout(2)
        try:
            reply = s.recv(200)
        except OSError:
            pass
    time.sleep(0.5)
    peak = max(peak, _status(exp.proc.pid, "VmRSS"))
    answer = reply.split(b"\r\n", 1)[0].decode("latin-1") or "(none: connection reset)"
    return (f"chunk size -1, streamed for up to {seconds:g} s", f"{sent >> 20} MiB taken", answer,
            f"{rss0 / 1024:.0f} -> {peak / 1024:.0f} MB RSS")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.http_abuse", description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=512, help="connections per port (default 512)")
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each flood (default 20)")
    parser.add_argument("--source", type=Path, default=ROOT, help="checkout whose exporter to run")
    parser.add_argument("exporter_args", nargs="*", help="extra exporter flags (after --)")
    args = parser.parse_args(argv)
    print(f"### HTTP abuse: {args.source} ({subprocess.run(['git', '-C', str(args.source), 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip() or '?'})\n")  # noqa: E501
    print("| attack | probes answered (/metrics, /-/healthy, OTLP) | slowest answer ms | peak threads |")
    print("|---|--:|--:|--:|")
    for slow in (True, False):
        exp = _exporter(args.source, args.exporter_args)
        try:
            print("| " + " | ".join(flood_row(exp, args.connections, args.seconds, slow)) + " |", flush=True)
        finally:
            exp.stop()
    exp = _exporter(args.source, args.exporter_args)
    try:
        row = chunk_row(exp, min(args.seconds, 30.0))
    finally:
        exp.stop()
    print("\n| attack | body taken | answer | memory |")
    print("|---|--:|---|---|")
    print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
