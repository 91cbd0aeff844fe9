"""GPU to pod attribution on Kubernetes (``--collector.kubernetes``, off by default).

Joins two inputs on the sampler thread: the per-GPU energy counters and identities the GPU collector
already sampled (``gpu_states``), and the kubelet's device assignments, which a ``PodResourcesWatcher``
refreshes on its own thread every ``--kubernetes.refresh-interval``. Neither this collector nor the
scrape path ever calls the kubelet or NVML: ``update`` reads the watcher's last answer and the GPU
collector's last states.

The split rules (exclusive, MIG slices, shared GPUs by SM utilisation or evenly) live in
``kubernetes.attribution``; docs/deploy.md explains them to users. A missing or forbidden socket means
no attribution, one clear log line and ``gpuenergy_k8s_pod_resources_available 0``; a failing List call
reports the collector as failed while the counters keep their values and the last known assignments stay
in use.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from prometheus_client.core import Metric

from gpu_energy_exporter.collectors.base import Collector, NoData
from gpu_energy_exporter.collectors.kubernetes.assignments import (
    STATE_OK,
    STATE_RPC_ERROR,
    AssignmentView,
    PodRef,
)
from gpu_energy_exporter.collectors.kubernetes.attribution import UNOWNED, PodEnergyAttributor, Slot, resolve
from gpu_energy_exporter.collectors.registry import CollectorSpec, Settings, Wiring, register
from gpu_energy_exporter.core.contract import gpu_key
from gpu_energy_exporter.core.errors import ExporterError
from gpu_energy_exporter.core.flagtypes import Flag, any_text, parse_bool, parse_duration
from gpu_energy_exporter.core.metrics import GPU_LABELS, add, define
from gpu_energy_exporter.core.state import GPUState

log = logging.getLogger(__name__)

_POD = ("k8s_namespace", "k8s_pod")

GPU_POD_INFO = define(
    "k8s", "gpu_pod_info", "info",
    "Which container holds which GPU, from the kubelet pod-resources API: one series per GPU (or MIG "
    "instance, mig_uuid) and container. Join on gpu_uuid to attribute any per-GPU series to pods.",
    (*GPU_LABELS, "mig_uuid", *_POD, "k8s_container"), collector="kubernetes",
)
POD_ENERGY = define(
    "k8s", "pod_energy_joules_total", "counter",
    "GPU energy attributed to the pod while it held GPUs, since the exporter saw it, settled at each read of "
    "the GPU's energy counter (it lags by at most --collector.energy-interval; the part since is "
    "..._pod_energy_provisional_joules). method: exclusive "
    "(whole GPU), mig_slices (parent GPU split by the compute slices of the held MIG instances), "
    "sm_utilization or shared_even (GPU shared by several pods). Sum over method for the pod's total.",
    (*_POD, "method"), collector="kubernetes", unit="joules",
)
CONTAINER_ENERGY = define(
    "k8s", "container_energy_joules_total", "counter",
    "GPU energy attributed to the container while it held GPUs (see ..._pod_energy_joules_total for "
    "method).",
    (*_POD, "k8s_container", "method"), collector="kubernetes", unit="joules",
)
POD_PROVISIONAL = define(
    "k8s", "pod_energy_provisional_joules", "gauge",
    "GPU energy charged to the pod since its GPUs' energy counters were last read: the power readings' "
    "estimate, not settled yet. The next counter read (every --collector.energy-interval, and at every pod "
    "start and stop) settles it into ..._pod_energy_joules_total and this gauge drops back. "
    "..._pod_energy_joules_total + this gauge is the pod's energy so far.",
    _POD, collector="kubernetes", unit="joules",
)
UNATTRIBUTED_ENERGY = define(
    "k8s", "unattributed_energy_joules_total", "counter",
    "GPU energy consumed while no pod held the GPU, since the kubernetes collector started (settled at each "
    "read of the GPU's energy counter, as the pods' counters).",
    GPU_LABELS, collector="kubernetes", unit="joules",
)
POD_RESOURCES_AVAILABLE = define(
    "k8s", "pod_resources_available", "gauge",
    "1 if the last kubelet pod-resources List succeeded; 0 with the reason label (pending, "
    "socket_missing, permission_denied, rpc_error) if not.",
    ("reason",), collector="kubernetes",
)

#: ``pid_to_pod(pid, candidates)``: the container (one of ``candidates``, the holders of the GPU) that
#: runs host process ``pid``, or None when unknown.
PidToPod = Callable[[int, Sequence[PodRef]], "PodRef | None"]


class AssignmentSource(Protocol):
    """What the collector needs from ``kubernetes.podresources.PodResourcesWatcher``."""

    def start(self) -> None: ...

    def view(self) -> AssignmentView: ...

    def close(self) -> None: ...


class KubernetesCollector(Collector):
    """Per-pod and per-container GPU energy, and the GPU -> pod info series."""

    name = "kubernetes"
    depends_on = ("gpu",)  # integrates the energy the gpu collector just read

    def __init__(
        self,
        gpu_states: Callable[[], Sequence[GPUState]],
        source: AssignmentSource,
        *,
        pid_to_pod: PidToPod | None = None,
        series_grace_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        request_counter_read: Callable[[], None] | None = None,
    ) -> None:
        """``gpu_states``: the GPU collector's latest states (``GPUCollector.states``); run this
        collector after the GPU collector so each update sees the same sample. ``source``: a started or
        unstarted ``PodResourcesWatcher`` (started on the first update, closed by ``close``).
        ``pid_to_pod``: resolves GPU processes to containers so a shared GPU is split by SM utilisation;
        without it shared GPUs are split evenly. ``request_counter_read``: ``Exporter.read_counters_now``,
        called when the holders of a GPU changed and this sample did not read its energy counter (a pod's
        start or stop is then a counter read; the watcher calls it itself as soon as a refresh sees the
        change, ``PodResourcesWatcher.on_change``)."""
        self._gpu_states = gpu_states
        self._source = source
        self._pid_to_pod = pid_to_pod
        self._clock = clock
        self._attributor = PodEnergyAttributor(series_grace_s)
        self._started = False
        self._gpu_index: dict[str, str] = {}
        self._unresolved_logged: frozenset[str] = frozenset()
        self._request_counter_read = request_counter_read
        self._holdings: dict[str, tuple[Slot, ...]] | None = None  # the last update's
        self._pod_devices: dict[tuple[str, str], frozenset[str]] | None = None  # None: no answer yet

    @classmethod
    def from_config(
        cls, cfg: Settings, gpu_states: Callable[[], Sequence[GPUState]], **kwargs: object
    ) -> KubernetesCollector:
        """The collector as the exporter runs it: a watcher on ``--kubernetes.pod-resources-socket``
        refreshed every ``--kubernetes.refresh-interval``. Imports grpc (the ``[kubernetes]`` extra) and
        raises ``ExporterError`` saying how to install it when it is missing or too old."""
        try:
            from gpu_energy_exporter.collectors.kubernetes.podresources import PodResourcesWatcher
        except Exception as exc:  # ImportError, or the generated code's grpcio/protobuf version check
            raise ExporterError(
                "--collector.kubernetes needs grpcio and a recent protobuf: pip install "
                f"'gpu-energy-exporter[kubernetes]' ({type(exc).__name__}: {exc})"
            ) from None
        # A refresh that changes who holds a GPU has the energy counters read at once (a pod's edge).
        on_change = kwargs.get("request_counter_read")
        watcher = PodResourcesWatcher(cfg.kubernetes_pod_resources_socket, cfg.kubernetes_refresh_interval,
                                      on_change=on_change if callable(on_change) else None)
        return cls(gpu_states, watcher, **kwargs)  # type: ignore[arg-type]

    @property
    def attributor(self) -> PodEnergyAttributor:
        return self._attributor

    def update(self) -> list[Metric]:
        if not self._started:
            self._started = True
            self._source.start()
        view = self._source.view()

        states = list(self._gpu_states())
        identities = [s.identity for s in states]
        for g in identities:
            self._gpu_index[g.uuid] = str(g.index)
        holdings, unresolved = resolve(view.assignments or (), identities)
        self._log_unresolved(unresolved)
        energy = {s.identity.uuid: s.energy_j for s in states if s.energy_j is not None}
        weights, owners = self._weights(states, holdings) if self._pid_to_pod is not None else (None, None)
        changed = self._holdings is not None and holdings != self._holdings
        self._attributor.update(self._clock(), energy, holdings, weights, states={s.identity.uuid: s for s in states},
                                owners=owners, changed_at=view.refreshed_at if changed else None)
        if changed and self._request_counter_read is not None and self._unread(states, holdings):
            self._request_counter_read()  # the edge falls on the next counter read, taken at once
        self._holdings = holdings
        if view.assignments is not None:
            devices = _devices_by_pod(holdings)
            # a listed pod that holds no GPU may report none (otlp.podgpus); one whose device ids did not
            # resolve to this node's GPUs stays unknown
            holders = {(a.pod.namespace, a.pod.pod) for a in view.assignments}
            for pod in view.pods or ():
                if pod not in holders:
                    devices[pod] = frozenset()
            self._pod_devices = devices

        families = self._families(holdings, view.state)
        if view.state == STATE_RPC_ERROR:
            # A failure, yet the counters stay exposed (a gap would make increase() undefined): NoData
            # carries the families, and the watcher has already logged the cause once.
            raise NoData(view.message, families)
        if view.state != STATE_OK:
            # No socket, no permission, or no answer yet: no attribution, said once by the watcher.
            raise NoData(view.message or view.state, families)
        return families

    def devices_of(self, namespace: str, pod: str) -> frozenset[str] | None:
        """The GPUs and MIG instances (uuid keys: lower case, no ``GPU-`` prefix) the kubelet gave ``pod``, as of
        the last update (empty: the pod holds none); None when the kubelet has not answered yet, or its answer
        does not list the pod (it started since). Any thread (the OTLP receivers: ``otlp.podgpus``)."""
        known = self._pod_devices
        return None if known is None else known.get((namespace, pod))

    def _unread(self, states: Sequence[GPUState], holdings: dict[str, tuple[Slot, ...]]) -> bool:
        """Whether a GPU whose holders changed was not read by its energy counter in this sample."""
        assert self._holdings is not None
        for s in states:
            u = s.identity.uuid
            if holdings.get(u, ()) != self._holdings.get(u, ()) and (
                    s.span is None or s.read_at is None or s.span.anchor_at != s.read_at):
                return True
        return False

    def _weights(
        self, states: Sequence[GPUState], holdings: dict[str, tuple[Slot, ...]]
    ) -> tuple[dict[str, dict[PodRef, float]], dict[str, dict[int, PodRef]]]:
        """Per GPU shared by several containers: the last SM weights per container (the reading's), and each
        listed process's container (what maps the per-process samples of this piece when it settles)."""
        assert self._pid_to_pod is not None
        out: dict[str, dict[PodRef, float]] = {}
        owners: dict[str, dict[int, PodRef]] = {}
        before = self._holdings or {}
        for s in states:
            # (the holders before this sample's change too: the piece before the edge is theirs)
            slots = (*holdings.get(s.identity.uuid, ()), *before.get(s.identity.uuid, ()))
            candidates = sorted({slot.pod for slot in slots if not slot.mig_uuid})
            if len(candidates) < 2 or s.reading is None or not s.reading.processes:
                continue
            placed: dict[int, PodRef] = {}
            w: dict[PodRef, float] = defaultdict(float)
            for p in s.reading.processes:
                pod = self._pid_to_pod(p.pid, candidates)
                # A process in no pod holding the GPU (or not placed) keeps its share, as unattributed.
                placed[p.pid] = pod if pod is not None and pod in candidates else UNOWNED
                # No sample for a listed process: it used no SMs in the period NVML reported on.
                w[placed[p.pid]] += p.sm_util_pct or 0.0
            owners[s.identity.uuid] = placed
            if any(p.sm_util_pct is not None for p in s.reading.processes) and any(
                    v > 0 for pod, v in w.items() if pod != UNOWNED):
                out[s.identity.uuid] = dict(w)
        return out, owners

    def _families(self, holdings: dict[str, tuple[Slot, ...]], state: str) -> list[Metric]:
        info = GPU_POD_INFO.family()
        seen: set[tuple[str, ...]] = set()
        for gpu_uuid in sorted(holdings):
            for slot in holdings[gpu_uuid]:
                labels = (self._gpu_index.get(gpu_uuid, ""), gpu_uuid, slot.mig_uuid, slot.pod.namespace,
                          slot.pod.pod, slot.pod.container)
                if labels not in seen:
                    seen.add(labels)
                    add(info, [], dict(zip(GPU_POD_INFO.labels, labels, strict=True)))
        container = CONTAINER_ENERGY.family()
        for (pod, method), joules in sorted(self._attributor.container_energy().items()):
            add(container, [pod.namespace, pod.pod, pod.container, method], joules)
        pod_family = POD_ENERGY.family()
        for (namespace, name, method), joules in sorted(self._attributor.pod_energy().items()):
            add(pod_family, [namespace, name, method], joules)
        provisional = POD_PROVISIONAL.family()
        for (namespace, name), joules in sorted(self._attributor.pod_provisional().items()):
            add(provisional, [namespace, name], joules)
        unattributed = UNATTRIBUTED_ENERGY.family()
        for gpu_uuid, joules in sorted(self._attributor.unattributed_energy().items()):
            add(unattributed, [self._gpu_index.get(gpu_uuid, ""), gpu_uuid], joules)
        available = POD_RESOURCES_AVAILABLE.family()
        add(available, ["" if state == STATE_OK else state], 1.0 if state == STATE_OK else 0.0)
        return [info, container, pod_family, provisional, unattributed, available]

    def _log_unresolved(self, unresolved: list[str]) -> None:
        current = frozenset(unresolved)
        new = current - self._unresolved_logged
        if new:
            log.warning(
                "kubelet device ids match no GPU of this node, their energy is not attributed: %s "
                "(is the device plugin's id strategy uuid or index, and does NVML see every GPU?)",
                ", ".join(sorted(new)),
            )
        self._unresolved_logged = current

    def close(self) -> None:
        self._source.close()


def _devices_by_pod(holdings: dict[str, tuple[Slot, ...]]) -> dict[tuple[str, str], frozenset[str]]:
    """(namespace, pod) -> the uuid keys of the GPUs (and MIG instances, with their parent) it holds."""
    out: dict[tuple[str, str], set[str]] = defaultdict(set)
    for gpu, slots in holdings.items():
        for slot in slots:
            keys = out[(slot.pod.namespace, slot.pod.pod)]
            for uuid in (gpu, slot.mig_uuid):
                if uuid:
                    keys.add(gpu_key(uuid))
    return {pod: frozenset(keys) for pod, keys in out.items()}


def _build(w: Wiring) -> KubernetesCollector:
    gpu: Any = w.require("gpu", "kubernetes")
    from gpu_energy_exporter.collectors.gpu_processes import ProcfsPods

    # Processes NVML lists are placed in pods through the host's /proc (hostPID or the host's /proc mounted,
    # docs/deploy.md), so a time-sliced GPU is split by each pod's SM use. A pod's start and stop read every
    # energy counter at once (the refresh that sees it, else the sample that does): its settled energy covers
    # its own interval (issue 28).
    return KubernetesCollector.from_config(w.config, gpu.states, pid_to_pod=ProcfsPods(w.config.path_procfs),
                                           request_counter_read=w.read_counters_now)


register(CollectorSpec(
    "kubernetes", False, "GPU to pod attribution through the kubelet pod-resources API.", order=50, build=_build,
    title="Kubernetes pod attribution (collector `kubernetes`)",
    flags=(
        Flag("kubernetes.pod-resources-socket", any_text, "/var/lib/kubelet/pod-resources/kubelet.sock",
             "Kubelet pod-resources socket used to attribute GPUs to pods.", "PATH"),
        Flag("kubernetes.refresh-interval", parse_duration, "10s",
             "How often the GPU to pod mapping is refreshed from the kubelet.", "DURATION"),
        Flag("kubernetes.pod-identity", parse_bool, "true",
             "Know an OTLP push from a pod's address as that pod (this node's pods, listed from the API server; "
             "RBAC pods list), and refuse its points for GPUs the pod does not hold (docs/security.md).",
             boolean=True),
        Flag("kubernetes.api-url", any_text, "", "Kubernetes API server for --kubernetes.pod-identity (default: "
             "in the pod, KUBERNETES_SERVICE_HOST/PORT, with the service account's token and CA).", "URL"),
        Flag("kubernetes.node-name", any_text, "", "This node's name, whose pods --kubernetes.pod-identity lists "
             "(default: $NODE_NAME, set from the downward API's spec.nodeName).", "NAME"),
    ),
))
