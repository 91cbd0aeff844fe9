"""Who pushed a point: the identity the OTLP receiver gives every point, and the client string the store and the
run ledger check a run's lifecycle and per-identity quotas against.

Identity is established by the transport, never asserted (docs/security.md):

- ``Peer`` is what the receiver established about a sender before reading a byte of its request: the peer
  process as the kernel sees it (a loopback TCP connection through the socket table, a Unix-domain socket
  through ``SO_PEERCRED``: ``http.peers``), a per-tenant bearer token (the tenant), or the peer's address when
  nothing better is known (a remote host or a pod: a TCP handshake cannot complete from an address the sender
  does not own, except on loopback, where any local process may bind 127.x.y.z, so a loopback address is never
  an identity). On Kubernetes a pod's address is resolved through the API server to the pod itself
  (``pod_peer``: its uid, so a pod that reuses a deleted pod's address is another identity). ``key`` is the
  identity (what quotas count by); ``principal`` the group it belongs to (a Unix user, a tenant, an address, a
  pod's namespace): the processes of one multi-rank job share it.
- The resource's attributes (``host.name``, ``process.pid``, ``service.instance.id``) are claims. They narrow
  an identity (two helpers in one process are two clients: a run's rank belongs to the one that pushed it
  first) and never widen it: two identities are never one client whatever they claim. ``process.pid`` is
  checked against the kernel's peer (``claim_refusal``: its pid, its pid in any pid namespace, a descendant's).
  Only a trusted forwarder (``Peer.vouches``: an OpenTelemetry Collector listed in
  ``--otlp.trusted-forwarders``) makes its clients' claims their identity, under its own.

A client is one string: principal, key and the three claims, joined by ``_SEP``; split here only. Plain data:
this module never reads a socket, a file or a request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ipaddress

#: Resource attributes (as the receiver's sanitised labels) that identify the sending process.
HOST = "host_name"
PID = "process_pid"
INSTANCE = "service_instance_id"

_SEP = "\x1f"  # no attribute value or address carries it after translation... and if one does, it is removed

#: What the identity of a request is made from (``Peer.kind``).
KERNEL = "kernel"  # the peer process, from the socket table (loopback TCP) or SO_PEERCRED (Unix socket)
ADDRESS = "address"  # the peer's address: a remote host or a pod
TOKEN = "token"  # a per-tenant bearer token
POD = "pod"  # a Kubernetes pod, by its address on the pod network (kubernetes.podips)
UNRESOLVED = "unresolved"  # a loopback peer the kernel's tables did not show (it closed, or a race)


@dataclass(frozen=True, slots=True)
class Peer:
    """What the transport established about a sender (see the module docstring).

    ``pid``: the kernel's peer process (0 unknown: not root, another network namespace, or no kernel view);
    ``pids``: the ``process.pid`` claims the kernel confirms without looking further (the pid in each pid
    namespace); ``confirm``: a look-up for other claims (a descendant's pid), None when there is none.
    ``tag``: a short readable form of the identity, for a scoped run id and messages. ``pod``: the
    (namespace, name, uid) of the Kubernetes pod the connection comes from, when known: its points may name
    only the GPUs the kubelet gave that pod (``otlp.podgpus``), and its resource's ``k8s.pod.uid`` is that
    pod's (``otlp.translate``), so its ``process.pid`` can only be a process of that pod."""

    kind: str
    key: str
    principal: str
    tag: str
    pid: int = 0
    pids: frozenset[str] = frozenset()
    vouches: bool = False
    confirm: Callable[[str], bool] | None = field(default=None, compare=False, repr=False)
    pod: tuple[str, str, str] | None = None

    def with_tenant(self, tenant: str) -> Peer:
        """This peer, pushing with ``tenant``'s token: the tenant is the identity, whatever the network path
        (the kernel's pid stays, to check ``process.pid`` against)."""
        name = _clean(tenant)
        return Peer(TOKEN, f"tenant={name}", f"tenant={name}", name, self.pid, self.pids, self.vouches, self.confirm,
                    self.pod)

    def trusted(self) -> Peer:
        """This peer as a trusted forwarder: it vouches for its clients' claims."""
        return Peer(self.kind, self.key, self.principal, self.tag, self.pid, self.pids, True, self.confirm, self.pod)


def address_peer(address: str) -> Peer:
    """A peer known by its address only (see the module docstring); "" is the anonymous peer."""
    if not address:
        return ANONYMOUS
    a = _clean(address)
    return Peer(ADDRESS, f"ip={a}", f"ip={a}", a)


def pod_peer(namespace: str, name: str, uid: str) -> Peer:
    """A Kubernetes pod, found by its address: the identity is the pod (its uid: a pod that later gets the same
    address, or the same name, is another one); the principal its namespace, so the pods of one job on this
    node (one namespace) may add ranks to one run, as the processes of one user may."""
    ns, pod, u = _clean(namespace), _clean(name), _clean(uid)
    # the tag (a scoped run id's suffix) names the pod and its uid: a pod name alone is predictable (a
    # StatefulSet's, a Job's), and a neighbour could squat <run id>~<name> before the victim is scoped there
    return Peer(POD, f"pod={ns}/{pod}@{u}", f"ns={ns}", f"{ns}.{pod}.{u[:8]}", pod=(ns, pod, u))


def kernel_peer(uid: int, pid: int = 0, start: str = "", ns_pids: Iterable[int] = (),
                confirm: Callable[[str], bool] | None = None) -> Peer:
    """The peer process as the kernel sees it: ``uid`` always, ``pid`` (0 unknown) and its start time (so a
    reused pid is another identity), its pid in every pid namespace (``NSpid``)."""
    principal = f"uid={uid}"
    if not pid:
        return Peer(KERNEL, principal, principal, f"uid{uid}")
    pids = frozenset({str(pid), *(str(p) for p in ns_pids)})
    return Peer(KERNEL, f"{principal} pid={pid}@{start}", principal, f"pid{pid}", pid, pids, False, confirm)


#: A loopback peer whose socket the kernel's tables did not show: never its (forgeable) address.
UNRESOLVED_LOCAL = Peer(UNRESOLVED, "local=unresolved", "local=unresolved", "local")
ANONYMOUS = Peer(ADDRESS, "", "", "anonymous")


def parse_ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``address`` as an IP address (a ``%zone`` dropped, an IPv4-mapped IPv6 address as its IPv4 one), or None
    when it is not one."""
    import ipaddress

    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _clean(value: str) -> str:
    return value.replace(_SEP, "")


def _claims(resource: Iterable[tuple[str, str]]) -> tuple[str, str, str]:
    host = pid = instance = ""
    for key, value in resource:
        if key == HOST:
            host = value
        elif key == PID:
            pid = value
        elif key == INSTANCE:
            instance = value
    return host, pid, instance


def client_id(peer: Peer | str, resource: Iterable[tuple[str, str]]) -> str:
    """The client of a request from ``peer`` (a ``Peer``, or an address) whose resource has the (sanitised)
    labels ``resource``: the identity narrowed by the claims (or, for a forwarder that vouches, the claims
    under the forwarder's identity). "" is anonymous (no peer, no claims)."""
    if isinstance(peer, str):
        peer = address_peer(peer)
    host, pid, instance = (_clean(c) for c in _claims(resource))
    if not (peer.key or host or pid or instance):
        return ""  # anonymous: the same as a point recorded without a client
    principal, key = peer.principal, peer.key
    if peer.vouches and (host or pid):
        # a trusted forwarder's client: its own identity is what the forwarder vouches for
        principal = f"{principal}>host={host}"
        key = f"{principal} pid={pid}"
    return _SEP.join((principal, key, host, pid, instance))


def claim_refusal(peer: Peer, resource: Iterable[tuple[str, str]]) -> str | None:
    """Why the resource's ``process.pid`` contradicts what the kernel says of the peer, or None (no claim, no
    kernel pid to check it against, or a forwarder vouching for its clients)."""
    if not peer.pid or peer.vouches:
        return None
    claimed = _claims(resource)[1]
    if not claimed or claimed in peer.pids:
        return None
    if peer.confirm is not None and claimed.isdigit() and peer.confirm(claimed):
        return None
    return (f"process.pid {claimed[:20]!r} is not the pushing process: the kernel says the connection is "
            f"process {peer.pid} (uid {peer.principal.removeprefix('uid=')}); a process may only push as itself")


def _part(client: str, n: int) -> str:
    parts = client.split(_SEP)
    return parts[n] if len(parts) > n else ""


def identity_of(client: str) -> str:
    """The identity part of ``client`` (what quotas count by and what owns a run id)."""
    return _part(client, 1) if _SEP in client else client


def principal_of(client: str) -> str:
    """The principal of ``client``: the Unix user, tenant or address its identity belongs to."""
    return _part(client, 0) if _SEP in client else client


def node_of(client: str) -> str:
    """The principal and claimed host name of ``client``: the processes of one multi-rank job on one node (one
    user, one host) share it, so one may add a rank to a run another started."""
    return _SEP.join((principal_of(client), _part(client, 2)))


def tag_of(client: str) -> str:
    """A short readable form of ``client``'s identity (a scoped run id's suffix)."""
    key = identity_of(client)
    if " pid=" in key and ">" not in key:
        return "pid" + key.split(" pid=", 1)[1].split("@", 1)[0]
    if key.startswith("pod=") and " " not in key and ">" not in key:
        name, _, uid = key[4:].partition("@")
        return f"{name.replace('/', '.')}.{uid[:8]}"
    for prefix in ("tenant=", "ip=", "uid="):
        if key.startswith(prefix) and " " not in key and ">" not in key:
            return ("uid" if prefix == "uid=" else "") + key[len(prefix):]
    return "id" + format(_fnv(key), "08x")


def _fnv(text: str) -> int:
    h = 0x811C9DC5
    for ch in text.encode("utf-8", "replace"):
        h = ((h ^ ch) * 0x01000193) & 0xFFFFFFFF
    return h


def describe(client: str) -> str:
    """``client`` for a log line or a note."""
    if _SEP not in client:
        return client or "anonymous"
    parts = (client.split(_SEP) + ["", "", "", "", ""])[:5]
    labels = ("principal", "identity", "host", "pid", "instance")
    shown = [f"{k}={v}" for k, v in zip(labels, parts, strict=True) if v and not (k == "principal" and v == parts[1])]
    return " ".join(shown) or "anonymous"


def parse_forwarders(text: str) -> tuple[str, ...]:
    """``--otlp.trusted-forwarders``: a comma-separated list of ``uid=N`` (a local Collector's user), an address
    or network (``10.0.0.7``, ``10.1.0.0/16``) or ``tenant=NAME`` (a per-tenant token's tenant). ValueError
    saying which entry is wrong."""
    import ipaddress

    out: list[str] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.startswith("uid="):
            if not entry[4:].isdigit():
                raise ValueError(f"{entry!r}: uid= takes a number (the Collector's user id)")
        elif entry.startswith("tenant="):
            if not entry[7:]:
                raise ValueError(f"{entry!r}: tenant= takes the tenant's name from --otlp.bearer-token-file")
        else:
            try:
                entry = str(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                raise ValueError(f"{entry!r} is neither uid=N, tenant=NAME nor an address or network") from None
        out.append(entry)
    return tuple(out)


def forwarder_matches(peer: Peer, forwarders: tuple[str, ...]) -> bool:
    """Whether ``peer`` is one of the trusted forwarders (``parse_forwarders``). A loopback peer the kernel
    did not resolve never is: its address is anyone's."""
    if not forwarders or peer.kind == UNRESOLVED:
        return False
    import ipaddress

    address = peer.key[3:] if peer.kind == ADDRESS and peer.key.startswith("ip=") else ""
    for entry in forwarders:
        if entry.startswith(("uid=", "tenant=")):
            if peer.principal == entry:
                return True
        elif address:
            try:
                if ipaddress.ip_address(address.split("%", 1)[0]) in ipaddress.ip_network(entry):
                    return True
            except ValueError:
                continue
    return False
