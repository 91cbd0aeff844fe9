"""What the OTLP/gRPC receiver costs the exporter: resident memory and threads with it off, on but never
pushed to, after its first push (and how that push went), and the peak after floods of bad 4 MiB calls,
each on its own connection; then how long a client waits behind sockets that never send a word at
``--web.max-connections=4``.

``python -m bench.grpc_cost`` on one fake H100 at the defaults. For the "before" figures run the same file
from an older checkout (copy it there; the exporter is started from the checkout that holds
tests/helpers.py). Memory is VmRSS, the peak VmHWM, both from /proc/<pid>/status.

Never asserts a figure; talks only to the exporter it started on 127.0.0.1.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from pathlib import Path

import grpc

from bench import harness
from bench.harness import Context, Table, exporter, fmt

TITLE = "OTLP/gRPC receiver: memory and threads, first push, floods, silent sockets"
EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
GRPC_ON = "--otlp.grpc.listen-address=127.0.0.1:0"


def _hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    return float("nan")


def _loaded(pid: int) -> str:
    return "yes" if "cygrpc" in Path(f"/proc/{pid}/maps").read_text() else "no"


def _call(target: str, body: bytes, timeout: float = 30.0) -> str:
    """One Export call on a connection of its own, no retry policy: the code's name."""
    with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        try:
            channel.unary_unary(EXPORT)(body, timeout=timeout)
        except grpc.RpcError as exc:
            return str(exc.code().name)
    return "OK"


def run(ctx: Context) -> list[Table]:
    path = ctx.path("grpc-1gpu.ini")
    harness.write_scenario(path, harness.h100s(1))
    settle = ctx.pick(2.0, 10.0)
    rounds, calls = ctx.pick((1, 16), (3, 64))
    mem = Table("Exporter with the OTLP/gRPC receiver (1 fake H100, defaults)",
                ["state", "RSS MB", "peak RSS MB", "threads", "grpc loaded", "first call"],
                [f"Each state {settle:.0f} s after the step before it. Flood: {rounds} round(s) of {calls} calls of "
                 "4 MiB at once, each on its own connection, every message invalid (read whole, then refused)."])
    with exporter(ctx, scenario=path, args=["--otlp.grpc.listen-address="]) as exp:
        time.sleep(settle)
        mem.add("receiver off", fmt(harness.rss_bytes(exp.pid) / 1e6), fmt(_hwm_mb(exp.pid)),
                harness.thread_count(exp.pid), _loaded(exp.pid), "")
    with exporter(ctx, scenario=path, args=[GRPC_ON, "--web.request-timeout=60s"]) as exp:
        target = exp.grpc_endpoint.split("//", 1)[1]
        time.sleep(settle)
        mem.add("receiver on, never pushed to", fmt(harness.rss_bytes(exp.pid) / 1e6), fmt(_hwm_mb(exp.pid)),
                harness.thread_count(exp.pid), _loaded(exp.pid), "")
        started = time.monotonic()
        first = _call(target, b"")
        first_s = time.monotonic() - started
        time.sleep(settle)
        mem.add("after the first push", fmt(harness.rss_bytes(exp.pid) / 1e6), fmt(_hwm_mb(exp.pid)),
                harness.thread_count(exp.pid), _loaded(exp.pid), f"{first} in {first_s * 1e3:.0f} ms")
        body = b"\x0a" + b"\xff" * ((4 << 20) - 1)
        for n in range(rounds):
            threads = [threading.Thread(target=_call, args=(target, body, 120.0)) for _ in range(calls)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(180)
            mem.add(f"after flood round {n + 1}", fmt(harness.rss_bytes(exp.pid) / 1e6), fmt(_hwm_mb(exp.pid)),
                    harness.thread_count(exp.pid), _loaded(exp.pid), "")
    return [mem, _silent(ctx)]


def _silent(ctx: Context) -> Table:
    t = Table("A client behind silent sockets (--web.max-connections=4, 4 sockets that never send a byte)",
              ["attempt", "code", "seconds since the sockets opened"],
              ["Bare grpc calls with no retry policy, one every 0.5 s until one succeeds; the silent sockets "
               "are closed by the exporter at its handshake timeout."])
    with exporter(ctx, args=["--no-collector.gpu", GRPC_ON, "--web.max-connections=4"]) as exp:
        target = exp.grpc_endpoint.split("//", 1)[1]
        _call(target, b"")  # grpc loaded, as on a node that receives pushes
        time.sleep(1.0)  # that connection closed: it held one of the 4 slots
        host, port = target.rsplit(":", 1)
        silent = [socket.create_connection((host, int(port)), timeout=30) for _ in range(4)]
        opened = time.monotonic()
        try:
            for attempt in range(1, 61):
                code = _call(target, b"", timeout=5.0)
                t.add(attempt, code, fmt(time.monotonic() - opened))
                if code == "OK":
                    break
                time.sleep(0.5)
        finally:
            for s in silent:
                s.close()
    if len(t.rows) > 4:  # the first, the last two and the success
        t.rows = [t.rows[0], *t.rows[-3:]]
    return t


if __name__ == "__main__":
    sys.exit(harness.main_for("bench.grpc_cost"))
