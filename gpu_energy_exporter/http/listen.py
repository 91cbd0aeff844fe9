"""Where a server listens: binding its socket, the open-files budget per port, and the address as a
client or a person reads it (``client_url``, ``listen_text``).

``bind(("", port))`` is every interface (one dual-stack IPv6 socket where the host has IPv6, else IPv4);
``"0.0.0.0"``, ``"::"``, ``"[::1]"``, ``"127.0.0.1"`` and host names work as expected. A bind failure
raises ``ConfigError`` naming the address. This module never reads or writes a connection.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import resource
import socket
from typing import Any

from gpu_energy_exporter.core.errors import ConfigError


def connection_cap() -> int:
    """Connections one port may hold within the open-files limit: the soft limit is raised to the hard one
    first (as Go's runtime does), then a third of it is left to each of the two ports, the rest to the
    process (NVML, files, the kubelet socket)."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                soft = target
            except (ValueError, OSError):
                pass
    except (ValueError, OSError):
        return 1 << 20
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(8, (soft - 64) // 3)


def client_url(address: tuple[str, int], scheme: str = "http") -> str:
    """The URL a client on this host uses for a server bound to ``address`` (a wildcard address is
    reached through loopback)."""
    host, port = address[0], address[1]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def listen_text(host: str, port: int, url: str, dual_stack: bool) -> str:
    """``:9863 on all interfaces (IPv4 and IPv6; http://[::1]:9863 from this host)`` for a wildcard address,
    else the URL: a server bound to ``::`` does not listen on ``[::1]`` only, as its client URL would say."""
    if host in ("0.0.0.0", "::", ""):
        family = "IPv4 only" if host == "0.0.0.0" else "IPv4 and IPv6" if dual_stack else "IPv6 only"
        return f":{port} on all interfaces ({family}; {url} from this host)"
    return url


def dual_stack(sock: socket.socket) -> bool:
    """Whether an IPv6 socket also takes IPv4 connections."""
    if sock.family != socket.AF_INET6:
        return False
    try:
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 0
    except OSError:
        return False


#: Mode of a Unix-domain socket the exporter listens on: any local user may connect (each connection is
#: identified by the kernel's SO_PEERCRED, not by who could open the file).
UNIX_SOCKET_MODE = 0o666


def bind_unix(path: str, mode: int = UNIX_SOCKET_MODE) -> socket.socket:
    """A listening Unix-domain socket at ``path`` (its directory created, mode 0755, when missing; a stale
    socket left by an exporter that died is replaced, any other file is not); ``ConfigError`` saying what to
    do when it cannot be used."""
    import stat

    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, mode=0o755, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create the directory of the OTLP Unix socket {path!r}: {exc.strerror} "
                          "(create it, writable by the exporter's user, or choose another path)") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise ConfigError(f"cannot use the Unix socket path {path!r}: {exc.strerror}") from None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"cannot listen on {path!r}: a file that is not a socket is there; remove it or "
                              "choose another path")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens: a socket left by an exporter that stopped uncleanly
        else:
            raise ConfigError(f"cannot listen on {path!r}: another process is listening there; stop it or "
                              "choose another path") from None
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        os.chmod(path, mode)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on the Unix socket {path!r}: {exc.strerror or exc}") from None
    return sock


def close_listener(sock: socket.socket, unix_path: str | None) -> None:
    """Close a listening socket (once); a Unix-domain one's file goes too: nobody listens on it any more."""
    if sock.fileno() < 0:
        return
    sock.close()
    if unix_path:
        try:
            os.unlink(unix_path)
        except OSError:
            pass


def bind(address: tuple[str, int]) -> socket.socket:
    """A listening socket for ``address``; ``ConfigError`` naming it when it cannot be used."""
    host, port = address
    host = host.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    candidates: list[tuple[socket.AddressFamily, tuple[Any, ...], bool]]
    if host == "":
        # Every interface: one dual-stack IPv6 socket, or IPv4 where the host has no IPv6.
        candidates = [(socket.AF_INET6, ("::", port), True), (socket.AF_INET, ("0.0.0.0", port), False)]
    else:
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
            except socket.gaierror as exc:
                raise ConfigError(f"cannot listen on {shown}: host name does not resolve ({exc.strerror})") from None
            # Like Go's net.Listen: one socket, IPv4 first when the name has both (localhost).
            infos.sort(key=lambda i: i[0] != socket.AF_INET)
            candidates = [(i[0], i[4], False) for i in infos[:1]]
        else:
            if ip.version == 6:
                candidates = [(socket.AF_INET6, (host, port), str(ip) == "::")]
            else:
                candidates = [(socket.AF_INET, (host, port), False)]
    last: OSError | None = None
    for family, sockaddr, dualstack in candidates:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if dualstack:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(sockaddr)
            sock.listen(1024)
            return sock
        except OSError as exc:
            sock.close()
            last = exc
            if host == "" and exc.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT):
                continue  # no IPv6 here: fall back to IPv4
            break
    assert last is not None
    hint = " (another process is using this port; choose another listen address)" \
        if last.errno == errno.EADDRINUSE else ""
    raise ConfigError(f"cannot listen on {shown}: {last.strerror or last}{hint}") from None
