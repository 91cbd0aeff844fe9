"""Which pod an address on the pod network is: the identity of an OTLP push from a pod (docs/security.md).

A pod on its own network namespace reaches the exporter (a hostNetwork DaemonSet) from its pod IP; the kernel's
socket table of the node's namespace does not show the process, but the address cannot be forged (a TCP
handshake does not complete from an address the sender does not own), and the Kubernetes API says which pod
holds it. ``PodDirectory`` keeps this node's pods by address, from the API server's pod list for the node
(``GET /api/v1/pods?fieldSelector=spec.nodeName=<node>``: RBAC ``pods`` list; not the kubelet's ``/pods``,
which needs ``nodes/proxy``, a right that also opens exec into every pod of the node).

Rules:

- Only pods that hold their own address: hostNetwork pods share the node's (their processes are on the node's
  network, so the socket table finds them), and pods that ended (``Succeeded``, ``Failed``) gave theirs back.
- A pod is known by its uid: a new pod that gets a deleted pod's address is another identity.
- The list is fetched when it is older than ``refresh_s`` and, for an address it does not hold, again at most
  once a second (a pod that just started); a fetch that fails keeps the last list. An address no pod holds is
  left to the caller (a host off the node is known by its address).

Never on the sampler thread; a look-up blocks at most ``timeout_s`` for a fetch, and only the thread that asks
(the OTLP receivers call it from request threads, never from the gRPC event loop).
"""

from __future__ import annotations

import json
import logging
import math
import os
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from gpu_energy_exporter.core.clientid import Peer, parse_ip, pod_peer
from gpu_energy_exporter.core.errors import ConfigError

log = logging.getLogger(__name__)

SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
#: The most a pod list may hold (one node's pods: a few hundred KiB at 110 pods); a bigger answer is refused.
MAX_LIST_BYTES = 32 << 20
MISS_REFRESH_S = 1.0
REFUSED_BACKOFF_S = 300.0
#: The most one fetch may take, connection to last byte (the socket timeout bounds each operation only).
FETCH_DEADLINE_S = 3.0
_ENDED = ("Succeeded", "Failed")

Fetch = Callable[[], bytes]


def pods_by_address(doc: Mapping[str, Any]) -> dict[str, Peer]:
    """A ``PodList`` (JSON, decoded) as address -> pod identity (``core.clientid.pod_peer``), by the rules of
    the module docstring. Entries it cannot read are skipped."""
    out: dict[str, Peer] = {}
    items = doc.get("items") if isinstance(doc, Mapping) else None
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        meta, spec, status = (_mapping(item.get(k)) for k in ("metadata", "spec", "status"))
        if spec.get("hostNetwork") is True or status.get("phase") in _ENDED:
            continue
        ns, name, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
        if not (isinstance(ns, str) and isinstance(name, str) and isinstance(uid, str) and ns and name and uid):
            continue
        addresses = [status.get("podIP")]
        ips = status.get("podIPs")
        addresses += [e.get("ip") for e in ips if isinstance(e, Mapping)] if isinstance(ips, list) else []
        peer = pod_peer(ns, name, uid)
        for ip in addresses:
            if isinstance(ip, str) and ip:
                out[_canonical(ip)] = peer
    return out


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class PodDirectory:
    """This node's pods by address (see the module docstring). ``fetch`` returns the pod list's JSON bytes
    (``api_fetch``), raising ``OSError`` or ``ValueError`` when it cannot. Thread-safe."""

    def __init__(self, fetch: Fetch, *, refresh_s: float = 10.0, miss_refresh_s: float = MISS_REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.refresh_s = refresh_s
        self.miss_refresh_s = miss_refresh_s
        self._clock = clock
        self._pods: dict[str, Peer] = {}
        self._missed: set[str] = set()  # addresses a fetch did not find, until the next full refresh
        self._fetched_at: float | None = None  # the last fetch tried (whatever it gave)
        self._refused_until = -math.inf  # after a 401/403: the RBAC will not fix itself in a second
        self._lock = threading.Lock()  # one fetch at a time
        self.fetches = 0
        self.failures = 0
        self.available = False  # the last fetch succeeded
        self.error = "not fetched yet"

    def pod_of(self, address: str) -> Peer | None:
        """The pod that holds ``address`` now, or None (no pod of this node holds it, or no list could be had).
        A known address is answered at once from the list, a stale one too while another thread refreshes it;
        an address not in the list waits for one fetch (at most once a second, and once per refresh interval
        for the same address: a host off the node pushing every second is not a fetch a second)."""
        address = _canonical(address)
        found = self._pods.get(address)
        age = self._age()
        if found is not None:
            if age >= self.refresh_s:
                self._refresh(self.refresh_s, wait=False)
                found = self._pods.get(address)
            return found
        if age < self.miss_refresh_s or (address in self._missed and age < self.refresh_s):
            return None
        self._refresh(self.miss_refresh_s, wait=True)
        found = self._pods.get(address)
        if found is None and self.available and len(self._missed) < 4096:
            self._missed.add(address)
        return found

    def _age(self) -> float:
        at = self._fetched_at
        return math.inf if at is None else self._clock() - at

    def _refresh(self, older_than: float, *, wait: bool) -> None:
        if not self._lock.acquire(blocking=wait):
            return  # another thread is fetching: the last list answers meanwhile
        try:
            if self._age() < older_than or self._clock() < self._refused_until:
                return  # another thread fetched while this one waited, or the API refused us a moment ago
            self._fetched_at = self._clock()
            self.fetches += 1
            try:
                pods = pods_by_address(json.loads(self._fetch()))
            except Exception as exc:  # noqa: BLE001 - whatever the API server or the path answers, never the push's
                self._failed(exc)
                return
            if not self.available:
                log.info("pod identity: %d pod address(es) on this node", len(pods))
            self._pods, self._missed = pods, set()
            self.available = True
            self.error = ""
        finally:
            self._lock.release()

    def _failed(self, exc: BaseException) -> None:
        self.failures += 1
        status = getattr(exc, "code", None)
        if status in (401, 403):
            self._refused_until = self._clock() + REFUSED_BACKOFF_S
            why = (f"the API server answered {status}: the service account needs 'list' on pods "
                   "(deploy/kubernetes/components/pod-identity); asked again in 5 minutes")
        else:
            why = f"{type(exc).__name__}: {exc}"
        if self.available or self.failures == 1:
            log.warning("cannot list this node's pods from the Kubernetes API (%s): pushes from pods are known by "
                        "their address until it answers; the last list (%d pods) stays in use",
                        why, len(set(self._pods.values())))
        self.available = False
        self.error = why[:300]


def _canonical(address: str) -> str:
    """An address as the pod list's keys are: no zone, IPv4-mapped IPv6 as IPv4, compressed IPv6."""
    ip = parse_ip(address)
    return address.split("%", 1)[0] if ip is None else ip.compressed


def api_fetch(api_url: str, node_name: str, *, token_file: str = SERVICE_ACCOUNT + "/token",
              ca_file: str = SERVICE_ACCOUNT + "/ca.crt", timeout_s: float = 2.0) -> Fetch:
    """A ``fetch`` of ``node_name``'s pods from the API server at ``api_url`` with the service account's token
    (read at each fetch: the kubelet rotates it) and CA. ``ConfigError`` for a URL that cannot be used."""
    parsed = urllib.parse.urlsplit(api_url)
    if parsed.scheme not in ("https", "http") or not parsed.netloc:
        raise ConfigError(f"--kubernetes.api-url {api_url!r} is not an http(s) URL")
    if not node_name:
        raise ConfigError("pod identity needs the node's name: set NODE_NAME from the downward API "
                          "(fieldRef spec.nodeName) or --kubernetes.node-name, or --no-kubernetes.pod-identity")
    # resourceVersion=0: served from the API server's watch cache, not a quorum read of etcd per node
    query = urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node_name}", "resourceVersion": "0"})
    if parsed.scheme == "http":
        log.warning("--kubernetes.api-url %s is plain http: the service account's token crosses the network "
                    "unencrypted", api_url)
    url = f"{api_url.rstrip('/')}/api/v1/pods?{query}"
    context = None
    if parsed.scheme == "https":
        context = ssl.create_default_context(cafile=ca_file if os.path.exists(ca_file) else None)

    def fetch() -> bytes:
        headers = {"Accept": "application/json"}
        try:
            with open(token_file, encoding="utf-8") as f:
                headers["Authorization"] = "Bearer " + f.read().strip()
        except OSError:
            pass  # no service account token: an API that allows the request anyway (or a 401/403, said)
        req = urllib.request.Request(url, headers=headers)
        deadline = time.monotonic() + FETCH_DEADLINE_S
        chunks: list[bytes] = []
        size = 0
        with urllib.request.urlopen(req, timeout=timeout_s, context=context) as r:  # noqa: S310 (http(s) only)
            while chunk := r.read(1 << 16):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_LIST_BYTES:
                    raise ValueError(f"the pod list is over {MAX_LIST_BYTES >> 20} MiB")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the pod list took over {FETCH_DEADLINE_S:g}s")
        return b"".join(chunks)

    return fetch


class PodIdentitySettings(Protocol):
    """The flags ``directory_from_config`` reads (the daemon's ``Config`` has them)."""

    @property
    def kubernetes_pod_identity(self) -> bool: ...

    @property
    def kubernetes_api_url(self) -> str: ...

    @property
    def kubernetes_node_name(self) -> str: ...

    @property
    def kubernetes_refresh_interval(self) -> float: ...

    def enabled(self, collector: str) -> bool: ...


def in_cluster_api_url(environ: Mapping[str, str]) -> str:
    """The API server's URL inside a pod (``KUBERNETES_SERVICE_HOST``/``_PORT``), "" outside one."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def directory_from_config(config: PodIdentitySettings, environ: Mapping[str, str]) -> PodDirectory | None:
    """The exporter's ``PodDirectory`` (``--kubernetes.pod-identity`` with ``--collector.kubernetes``), or None
    when it is off, or outside a cluster with no ``--kubernetes.api-url`` (said once in the log)."""
    if not (config.enabled("kubernetes") and config.kubernetes_pod_identity):
        return None
    url = config.kubernetes_api_url or in_cluster_api_url(environ)
    if not url:
        log.warning("--kubernetes.pod-identity: not in a pod (no KUBERNETES_SERVICE_HOST) and no "
                    "--kubernetes.api-url; pushes from pods are known by their address only")
        return None
    if not config.kubernetes_api_url and not os.path.exists(SERVICE_ACCOUNT + "/token"):
        log.warning("--kubernetes.pod-identity: no service account token in this pod (%s/token): pushes from pods "
                    "are known by their address only; deploy/kubernetes/components/pod-identity mounts it and grants "
                    "it read access to pods", SERVICE_ACCOUNT)
        return None
    node = config.kubernetes_node_name or environ.get("NODE_NAME", "")
    if not node and not config.kubernetes_api_url:
        log.warning("--kubernetes.pod-identity: this node's name is unknown (no NODE_NAME from the downward API's "
                    "spec.nodeName, no --kubernetes.node-name): pushes from pods are known by their address only")
        return None
    return PodDirectory(api_fetch(url, node), refresh_s=config.kubernetes_refresh_interval)
