"""The kernel's view of a connection's peer: which process is at the other end (``core.clientid.Peer``).

- A Unix-domain socket: ``SO_PEERCRED`` (pid, uid, gid as the kernel recorded them at ``connect``), read once
  when the connection is accepted (``credentials``).
- A TCP connection: the socket table, as ``ss -p`` does. ``<procfs>/self/net/tcp`` and ``tcp6`` (the exporter's
  own network namespace, where the connection arrived) list the client's socket, local address = the peer's
  address and port, with its owner's uid and its inode; the process holding that inode is found by reading the
  ``<procfs>/<pid>/fd`` links of the uid's processes (the owner's first, every process only when none holds it).
  A scan remembers every socket inode it saw (bounded), so a burst of new connections costs one scan, not one
  each; a remembered inode is checked again (one ``readlink``) before it is believed.

What it yields, and when it cannot see more (docs/security.md):

- the peer's socket is in the table and its process readable (root, or the same user): its uid, pid, start
  time (a reused pid is another identity) and its pid in every pid namespace (``NSpid``);
- in the table, process not readable (not root and another user's, ``hidepid``): its uid only (every process
  of that user is one identity); logged once;
- not in the table: a remote host or a pod in another network namespace: its address (a TCP handshake does not
  complete from an address the sender does not own), except a loopback address, which any local process may
  bind: ``UNRESOLVED_LOCAL`` (one identity for all such peers, never the address).

Cost: reading the table is O(sockets in the namespace); a scan is O(file descriptors of the uid's processes),
done only for an inode not seen before, at most one at a time. Callers cache the answer per connection
(``http.server`` on the connection); ``tcp`` also remembers each connection's answer, believed again only while
the process still holds the socket (``otlp.grpcreceiver``, which sees a call's peer address, not its connection).

``ConnectionInfo`` is what a request handler may know of its connection (``Request.connection``): the
addresses, a Unix peer's credentials (read once, at accept) and the identity a handler established for it.

This module reads ``/proc`` and its own sockets' options and nothing else, never writes, never blocks on a
client, and never raises for what it cannot read (it answers what it could establish).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import threading
from typing import Any

from gpu_energy_exporter.core.clientid import UNRESOLVED_LOCAL, Peer, address_peer, kernel_peer, parse_ip
from gpu_energy_exporter.core.procinfo import parse_nspid

log = logging.getLogger(__name__)

#: Socket inodes remembered from scans (inode -> (pid, fd)); cleared when full.
_MAX_REMEMBERED = 65536
#: Processes whose children a ``process.pid`` claim is looked for among (a trainer's own subprocesses).
_MAX_DESCENDANTS = 256


def credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of a connected Unix-domain socket's peer (``SO_PEERCRED``), None when not available."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _hex4(ip: ipaddress.IPv4Address) -> str:
    # /proc/net/tcp prints the address as one 32-bit word in host byte order (little-endian here)
    return f"{struct.unpack('=I', ip.packed)[0]:08X}"


def _hex6(ip: ipaddress.IPv6Address) -> str:
    words = struct.unpack("=4I", ip.packed)
    return "".join(f"{w:08X}" for w in words)


def table_keys(address: str, port: int) -> list[tuple[str, str]]:
    """(table file, ``local_address`` column) under which a socket bound to ``address``:``port`` is listed."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return []
    out: list[tuple[str, str]] = []
    if isinstance(ip, ipaddress.IPv6Address):
        mapped = ip.ipv4_mapped
        if mapped is not None:
            out.append(("tcp", f"{_hex4(mapped)}:{port:04X}"))
        out.append(("tcp6", f"{_hex6(ip)}:{port:04X}"))
    else:
        out.append(("tcp", f"{_hex4(ip)}:{port:04X}"))
        out.append(("tcp6", f"{_hex6(ipaddress.IPv6Address('::ffff:' + str(ip)))}:{port:04X}"))
    return out


def is_loopback(address: str) -> bool:
    ip = parse_ip(address)
    return ip is not None and ip.is_loopback


class PeerResolver:
    """``core.clientid.Peer`` for a connection's peer, from ``procfs`` (``--path.procfs``). Thread-safe."""

    def __init__(self, procfs: str = "/proc") -> None:
        self.procfs = procfs
        self._lock = threading.Lock()  # one scan at a time
        self._inodes: dict[int, tuple[int, int]] = {}
        self._tuples: dict[tuple[str, int, int], tuple[Peer, int, tuple[int, int] | None]] = {}
        self._blind_logged = False
        self.scans = 0  # fd scans made (bench/peer_lookup.py)

    # -- Unix-domain sockets

    def unix(self, creds: tuple[int, int, int] | None) -> Peer:
        """The peer of a Unix-domain socket from its ``SO_PEERCRED`` (``credentials``)."""
        if creds is None:
            return UNRESOLVED_LOCAL
        pid, uid, _gid = creds
        return self._process(uid, pid) if pid > 0 else kernel_peer(uid)

    # -- TCP

    def tcp(self, peer_address: str, peer_port: int, local_port: int) -> Peer:
        """The peer of a TCP connection from ``peer_address``:``peer_port`` to this host's ``local_port``.

        Remembered per connection (address, port, local port): a remembered process is believed again only
        while it still holds the socket it was found by (one ``readlink``); a TCP 4-tuple is unique while its
        socket lives, so a neighbour cannot take the port over until that process has closed it."""
        key = (peer_address, peer_port, local_port)
        hit = self._tuples.get(key)
        if hit is not None:
            peer, inode, where = hit
            if where is None or self._holds(where, inode):
                return peer
        found = self._table_entry(peer_address, peer_port, local_port)
        if found is None:
            if is_loopback(peer_address):
                return UNRESOLVED_LOCAL
            peer = address_peer(peer_address)
            self._remember(key, (peer, 0, None))
            return peer
        uid, inode = found
        held = self._holder(uid, inode)
        if held is None:
            return kernel_peer(uid)  # not remembered: the next call looks again
        peer = self._process(uid, held[0])
        self._remember(key, (peer, inode, held))
        return peer

    def known(self, peer_address: str, peer_port: int, local_port: int) -> Peer | None:
        """``tcp``'s answer when it is remembered and still holds (no table read, no scan), else None."""
        hit = self._tuples.get((peer_address, peer_port, local_port))
        if hit is None:
            return None
        peer, inode, where = hit
        return peer if where is None or self._holds(where, inode) else None

    def _remember(self, key: tuple[str, int, int], value: tuple[Peer, int, tuple[int, int] | None]) -> None:
        if len(self._tuples) >= _MAX_REMEMBERED // 16:
            self._tuples.clear()
        self._tuples[key] = value

    def _table_entry(self, address: str, port: int, local_port: int) -> tuple[int, int] | None:
        """(uid, inode) of the socket bound to ``address``:``port`` connected to our ``local_port``."""
        want_remote = f":{local_port:04X}"
        for table, local in table_keys(address, port):
            path = os.path.join(self.procfs, "self", "net", table)
            try:
                with open(path, encoding="ascii", errors="replace") as f:
                    text = f.read()
            except OSError:
                continue
            start = text.find(" " + local + " ")
            while start >= 0:
                end = text.find("\n", start)
                fields = text[start:end if end >= 0 else None].split()
                # local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                if len(fields) >= 9 and fields[0] == local and fields[1].endswith(want_remote):
                    try:
                        return int(fields[6]), int(fields[8])
                    except ValueError:
                        return None
                start = text.find(" " + local + " ", start + 1)
        return None

    def _holds(self, where: tuple[int, int], inode: int) -> bool:
        pid, fd = where
        try:
            return os.readlink(os.path.join(self.procfs, str(pid), "fd", str(fd))) == f"socket:[{inode}]"
        except OSError:
            return False

    def _holder(self, uid: int, inode: int) -> tuple[int, int] | None:
        """(pid, fd) of the process holding socket ``inode`` (owned by ``uid``); None when none readable does."""
        where = self._inodes.get(inode)
        if where is not None and self._holds(where, inode):
            return where
        with self._lock:
            where = self._inodes.get(inode)  # another thread's scan may have found it meanwhile
            if where is not None and self._holds(where, inode):
                return where
            self._scan(uid, inode, owners_only=True)
            where = self._inodes.get(inode)
            if where is None:
                self._scan(uid, inode, owners_only=False)  # a setuid process, or another user's
                where = self._inodes.get(inode)
        return where

    def _scan(self, uid: int, inode: int, *, owners_only: bool) -> None:
        self.scans += 1
        if len(self._inodes) > _MAX_REMEMBERED:
            self._inodes.clear()
        denied = 0
        try:
            entries = [e for e in os.scandir(self.procfs) if e.name.isdigit()]
        except OSError:
            return
        # the newest processes first: a connection just opened is more often a trainer's than a daemon's
        entries.sort(key=lambda e: -int(e.name))
        target = f"socket:[{inode}]"
        for entry in entries:
            try:
                if (entry.stat().st_uid == uid) != owners_only:
                    continue
                fds = os.scandir(os.path.join(entry.path, "fd"))
            except PermissionError:
                denied += 1
                continue
            except OSError:
                continue
            pid = int(entry.name)
            found = False
            with fds:
                for fd in fds:
                    try:
                        link = os.readlink(fd.path)
                    except OSError:
                        continue
                    if link.startswith("socket:["):
                        try:
                            self._inodes[int(link[8:-1])] = (pid, int(fd.name))
                        except ValueError:
                            continue
                        found = found or link == target
            if found:
                return
        if denied and not self._blind_logged:
            self._blind_logged = True
            log.warning("identifying local pushers by user only: %d processes' file descriptors under %s are not "
                        "readable (the exporter is not root); every process of one user is one identity "
                        "(docs/security.md)", denied, self.procfs)

    # -- the process

    def _process(self, uid: int, pid: int) -> Peer:
        base = os.path.join(self.procfs, str(pid))
        start = ""
        ns: tuple[int, ...] = ()
        try:
            with open(os.path.join(base, "stat"), encoding="ascii", errors="replace") as f:
                stat = f.read()
            start = stat[stat.rfind(")") + 2:].split()[19]
        except (OSError, IndexError):
            pass
        try:
            with open(os.path.join(base, "status"), encoding="ascii", errors="replace") as f:
                ns = parse_nspid(f.read())
        except OSError:
            pass

        def confirm(claim: str) -> bool:
            return self.descends(pid, claim)

        return kernel_peer(uid, pid, start, ns, confirm=confirm)

    def descends(self, pid: int, claim: str) -> bool:
        """Whether a process below ``pid`` (children, theirs, ...) has ``claim`` as its pid in some pid
        namespace: a trainer whose export runs in a subprocess of the connection's owner."""
        seen = 0
        todo = [pid]
        while todo and seen < _MAX_DESCENDANTS:
            p = todo.pop()
            seen += 1
            try:
                tasks = os.listdir(os.path.join(self.procfs, str(p), "task"))
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(os.path.join(self.procfs, str(p), "task", tid, "children"), encoding="ascii") as f:
                        children = [int(c) for c in f.read().split()]
                except (OSError, ValueError):
                    continue
                for c in children:
                    try:
                        with open(os.path.join(self.procfs, str(c), "status"), encoding="ascii",
                                  errors="replace") as f:
                            if claim == str(c) or claim in {str(x) for x in parse_nspid(f.read())}:
                                return True
                    except OSError:
                        pass
                    todo.append(c)
        return False


class ConnectionInfo:
    """What a handler may know of the connection a request came on (``Request.connection``): the peer's and
    the local address, the peer's ``SO_PEERCRED`` on a Unix-domain socket, and ``identity``, which a handler
    may set to what it established of the peer (``http.peers``) so that the connection's next requests reuse
    it. The connection's requests are handled one after the other, so no lock is needed."""

    __slots__ = ("peer", "local", "credentials", "unix", "identity")

    def __init__(self, peer: tuple[Any, ...], local: tuple[Any, ...], credentials: tuple[int, int, int] | None,
                 unix: bool) -> None:
        self.peer = peer
        self.local = local
        self.credentials = credentials
        self.unix = unix
        self.identity: object = None

    @classmethod
    def accepted(cls, sock: socket.socket, addr: tuple[Any, ...]) -> ConnectionInfo:
        """What there is to know of a connection just accepted, its socket set up for the server (non-blocking,
        TCP_NODELAY: a response goes out at once)."""
        sock.setblocking(False)
        unix = sock.family == socket.AF_UNIX
        if not unix:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        try:
            local = sock.getsockname()
        except OSError:
            local = ()
        if unix:
            return cls(addr, (str(local),), credentials(sock), True)
        return cls(addr, tuple(local), None, False)
