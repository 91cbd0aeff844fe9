"""What establishing a pusher's identity costs (issue 29, item 1): ``http.peers.PeerResolver`` on real sockets.

- A loopback TCP connection's first request: the socket table read and, for an inode not seen before, one scan
  of the owner's processes' file descriptors (``tcp``, cold), with 0, 100 and 300 extra processes of the
  same user alive, each holding 4 sockets, beside whatever else this machine runs; the pushing process newer
  than them (a scan looks at the newest first) or older (the slow case: it is found last).
- Every later request of the connection: nothing (the HTTP server keeps the answer on the connection); a
  gRPC call: one ``readlink`` (``known``).
- A Unix-socket connection (``SO_PEERCRED`` read at accept, then the process's ``stat`` and ``status``).

Medians of 20 new connections from one child process per row. Not part of ``python -m bench``: run
``python -m bench.peer_lookup``. Never asserts a figure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench.harness import Context, Table, fmt, median
from gpu_energy_exporter.http.peers import PeerResolver, credentials

TITLE = "Peer identity: socket table and SO_PEERCRED"

_HOLDER = ("import socket, time\nsocks = [socket.socket() for _ in range(4)]\ntime.sleep(600)")
_CLIENT = ("import socket, sys\nport = int(sys.argv[1])\nfor line in sys.stdin:\n"
           "    s = socket.socket(); s.bind(('127.0.0.' + line.strip(), 0)); s.connect(('127.0.0.1', port))\n"
           "    print(s.getsockname()[1], flush=True)\n    keep = globals().setdefault('keep', []); keep.append(s)\n")


def _processes() -> int:
    return sum(1 for name in os.listdir("/proc") if name.isdigit())


def run(ctx: Context) -> list[Table]:
    table = Table("Identity of a new loopback connection (PeerResolver.tcp) and of a later call (known)",
                  ["extra processes of the user", "pusher", "processes on the machine", "first request, ms (median)",
                   "first request, ms (max)", "later gRPC call, us", "scans"])
    rows = (0, 20) if ctx.quick else (0, 100, 300)
    for extra in rows:
        for older in (False, True):
            if older and not extra:
                continue
            table.add(extra, "older than them" if older else "newer", *_with_holders(extra, older, ctx.quick))
    unix = Table("Identity of a Unix-socket connection (SO_PEERCRED, PeerResolver.unix)",
                 ["connections", "per connection, us (median)"])
    unix.add(200, fmt(_measure_unix(200)))
    table.note("The first request of each connection is handled off the HTTP server's selector thread (one "
               "scan at a time; a scan remembers every socket it saw, so concurrent new connections share it). "
               "Run as root: every process's descriptors are readable.")
    return [table, unix]


def _with_holders(extra: int, older: bool, quick: bool) -> tuple[object, ...]:
    """``extra`` idle processes, started after the pushing process (``older``) or before it; the scan looks at
    the newest processes first, so a pusher older than them is the slow case."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        port = server.getsockname()[1]
        child = None
        if older:
            child = _client(port)
        holders = [subprocess.Popen([sys.executable, "-c", _HOLDER]) for _ in range(extra)]
        try:
            time.sleep(0.5 + extra / 100)
            child = child or _client(port)
            return (_processes(), *_measure(server, port, child, 5 if quick else 20))
        finally:
            for h in holders:
                h.kill()
            for h in holders:
                h.wait()


def _client(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CLIENT, str(port)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _measure(server: socket.socket, port: int, child: subprocess.Popen[str], n: int) -> tuple[str, str, str, int]:
    resolver = PeerResolver()
    assert child.stdin is not None and child.stdout is not None
    cold: list[float] = []
    warm: list[float] = []
    conns = []
    try:
        for i in range(n):
            child.stdin.write(f"{2 + i}\n")
            child.stdin.flush()
            child.stdout.readline()
            conn, addr = server.accept()
            conns.append(conn)
            t0 = time.perf_counter()
            peer = resolver.tcp(addr[0], addr[1], port)
            cold.append(time.perf_counter() - t0)
            assert peer.pid == child.pid, peer
            t0 = time.perf_counter()
            resolver.known(addr[0], addr[1], port)
            warm.append(time.perf_counter() - t0)
    finally:
        child.stdin.close()
        child.kill()
        child.wait()
        child.stdout.close()
        for c in conns:
            c.close()
    return fmt(median(cold) * 1e3), fmt(max(cold) * 1e3), fmt(median(warm) * 1e6), resolver.scans


def _measure_unix(n: int) -> float:
    resolver = PeerResolver()
    times = []
    with socket.socket(socket.AF_UNIX) as server:
        path = str(Path("/tmp") / f"gee-bench-{os.getpid()}.sock")
        server.bind(path)
        server.listen(n)
        try:
            for _ in range(n):
                client = socket.socket(socket.AF_UNIX)
                client.connect(path)
                conn, _ = server.accept()
                t0 = time.perf_counter()
                resolver.unix(credentials(conn))
                times.append(time.perf_counter() - t0)
                conn.close()
                client.close()
        finally:
            os.unlink(path)
    return median(times) * 1e6


if __name__ == "__main__":
    from bench.harness import main_for

    sys.exit(main_for("bench.peer_lookup"))
