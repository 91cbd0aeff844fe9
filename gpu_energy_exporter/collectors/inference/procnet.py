"""Which local process listens on a TCP port, and which processes descend from it, read from ``/proc``
(``--path.procfs``): ``net/tcp`` and ``net/tcp6`` (the listening sockets and their inodes), ``<pid>/fd`` (the
socket inodes a process holds) and ``<pid>/stat`` (its parent and start time).

This is how the inference collector finds the serving process behind a /metrics URL, and the servers among
the processes NVML lists on a GPU (vLLM's API server listens; its engine core and workers, its descendants,
are the GPU processes). Reads are bounded (a file read at most ``MAX_READ`` bytes, at most ``MAX_FDS``
descriptors of a process, ``MAX_DEPTH`` ancestors). A process that exits or that the exporter may not look into
is "not found", never an error. Never calls NVML, never opens a socket.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

#: bytes read of one /proc file (net/tcp of a busy host is large: a listening socket is usually near the top)
MAX_READ = 4 << 20
#: descriptors looked at per process, ancestors followed per process
MAX_FDS = 4096
MAX_DEPTH = 8
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp's st column


def listening(procfs: str) -> dict[int, tuple[str, int]]:
    """Socket inode -> (local address as the kernel writes it, port) of every listening TCP socket."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(os.path.join(procfs, "net", name), encoding="ascii", errors="replace") as f:
                text = f.read(MAX_READ)
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            addr, _, port = fields[1].partition(":")
            try:
                out[int(fields[9])] = (addr, int(port, 16))
            except ValueError:
                continue
    return out


def socket_inodes(procfs: str, pid: int) -> set[int]:
    """The socket inodes process ``pid`` holds (empty when it is gone or not ours to look into)."""
    base = os.path.join(procfs, str(pid), "fd")
    out: set[int] = set()
    try:
        names = os.listdir(base)[:MAX_FDS]
    except OSError:
        return out
    for name in names:
        try:
            target = os.readlink(os.path.join(base, name))
        except OSError:
            continue
        if target.startswith("socket:["):
            try:
                out.add(int(target[8:-1]))
            except ValueError:
                continue
    return out


def stat(procfs: str, pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks since boot) of ``pid``; None when it is gone."""
    try:
        with open(os.path.join(procfs, str(pid), "stat"), encoding="ascii", errors="replace") as f:
            text = f.read(4096)
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or parentheses: the fields start after the last ")".
    rest = text[text.rfind(")") + 2:].split()
    try:
        return int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return None


def ancestors(procfs: str, pid: int) -> list[int]:
    """``pid`` and its ancestors, nearest first (at most ``MAX_DEPTH``; pid 1 and the kernel's 0 excluded)."""
    out: list[int] = []
    while pid > 1 and len(out) < MAX_DEPTH and pid not in out:
        out.append(pid)
        st = stat(procfs, pid)
        if st is None:
            break
        pid = st[0]
    return out


def owner(procfs: str, inodes: Iterable[int], candidates: Iterable[int] = ()) -> int | None:
    """The pid holding one of the socket ``inodes``: the ``candidates`` looked at first, then every process."""
    wanted = set(inodes)
    if not wanted:
        return None
    for pid in candidates:
        if socket_inodes(procfs, pid) & wanted:
            return pid
    try:
        pids = [int(n) for n in os.listdir(procfs) if n.isdigit()]
    except OSError:
        return None
    for pid in pids:
        if socket_inodes(procfs, pid) & wanted:
            return pid
    return None


def listener(procfs: str, port: int, candidates: Iterable[int] = ()) -> int | None:
    """The pid of the process listening on TCP ``port`` (any local address), or None."""
    inodes = [inode for inode, (_, p) in listening(procfs).items() if p == port]
    return owner(procfs, inodes, candidates)


def start_ticks(procfs: str, pid: int) -> int | None:
    st = stat(procfs, pid)
    return st[1] if st is not None else None


def boot_time(procfs: str) -> float | None:
    """The host's boot time (Unix seconds, ``btime`` of ``/proc/stat``)."""
    try:
        with open(os.path.join(procfs, "stat"), encoding="ascii", errors="replace") as f:
            for line in f.read(MAX_READ).splitlines():
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def started_at(procfs: str, pid: int) -> float | None:
    """When ``pid`` started (Unix seconds), from its start ticks and the boot time; None when unknown."""
    ticks, boot = start_ticks(procfs, pid), boot_time(procfs)
    if ticks is None or boot is None:
        return None
    return boot + ticks / float(os.sysconf("SC_CLK_TCK"))
