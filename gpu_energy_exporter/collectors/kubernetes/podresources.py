"""Client of the kubelet pod-resources v1 API: which container holds which device on this node.

``PodResourcesWatcher`` calls ``PodResourcesLister.List`` over the kubelet's unix socket on its own
thread every refresh interval and keeps the last answer; readers (the kubernetes collector, on the
sampler thread) only take ``view()``, which never blocks on the kubelet. This module must never be called
from the scrape path and never calls List more often than the refresh interval.

States a user can see, each logged once when it starts (not on every refresh):
- the socket does not exist (not on Kubernetes, or the hostPath is not mounted): warning, no attribution;
- the socket exists but this user may not connect (the kubelet creates it for root only): warning with
  what to change, no attribution;
- List fails (kubelet restarting, timeout): error; the last good assignments stay in use;
- it works again: info.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import grpc

from gpu_energy_exporter.collectors.kubernetes import podresources_pb2 as pb
from gpu_energy_exporter.collectors.kubernetes import podresources_pb2_grpc as pb_grpc
from gpu_energy_exporter.collectors.kubernetes.assignments import (
    STATE_OK,
    STATE_PENDING,
    STATE_PERMISSION_DENIED,
    STATE_RPC_ERROR,
    STATE_SOCKET_MISSING,
    AssignmentView,
    DeviceAssignment,
    PodRef,
)

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
#: Extended resources of the NVIDIA device plugin: nvidia.com/gpu, nvidia.com/gpu.shared,
#: nvidia.com/mig-1g.10gb, ...
DEFAULT_RESOURCE_PREFIXES: tuple[str, ...] = ("nvidia.com/",)

# A big node lists every pod with its CPU ids and memory blocks; gRPC's 4 MiB default could be too small.
_MAX_MESSAGE_BYTES = 32 * 1024 * 1024


def parse_list_response(
    response: pb.ListPodResourcesResponse, resource_prefixes: Sequence[str] = DEFAULT_RESOURCE_PREFIXES
) -> tuple[DeviceAssignment, ...]:
    """Flatten a List answer to one ``DeviceAssignment`` per (container, device id) of the resources
    we care about. Dynamic resources (DRA) are not read: their device names are not GPU UUIDs."""
    out: list[DeviceAssignment] = []
    for p in response.pod_resources:
        for c in p.containers:
            ref = PodRef(p.namespace, p.name, c.name)
            for d in c.devices:
                if not d.resource_name.startswith(tuple(resource_prefixes)):
                    continue
                out.extend(DeviceAssignment(ref, d.resource_name, dev) for dev in d.device_ids)
    return tuple(out)


class PodResourcesClient:
    """One gRPC channel to the kubelet's pod-resources socket. The channel reconnects by itself when the
    kubelet restarts (it recreates the socket)."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        self._channel = grpc.insecure_channel(
            "unix://" + os.path.abspath(socket_path),
            options=[("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES)],
        )
        self._stub = pb_grpc.PodResourcesListerStub(self._channel)

    def list(self) -> pb.ListPodResourcesResponse:
        """One List call; raises ``grpc.RpcError`` on failure (fails fast, never waits for the kubelet
        beyond the timeout)."""
        response: pb.ListPodResourcesResponse = self._stub.List(
            pb.ListPodResourcesRequest(), timeout=self._timeout_s
        )
        return response

    def close(self) -> None:
        self._channel.close()


class PodResourcesWatcher:
    """Refreshes the container -> device assignments from the kubelet on a background thread."""

    def __init__(
        self,
        socket_path: str = DEFAULT_SOCKET,
        refresh_interval_s: float = 10.0,
        *,
        timeout_s: float = 5.0,
        resource_prefixes: Sequence[str] = DEFAULT_RESOURCE_PREFIXES,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """``on_change``: called (on the refreshing thread) after a refresh whose assignments differ from the
        last ones: the exporter reads the energy counters at once, so a pod's start and stop are counter
        reads (``Exporter.read_counters_now``). ``clock``: the clock of ``AssignmentView.refreshed_at``, the
        GPU readings' (monotonic) clock, where a pod's edge is placed."""
        if refresh_interval_s <= 0:
            raise ValueError("refresh_interval_s must be positive")
        self.socket_path = socket_path
        self.refresh_interval_s = refresh_interval_s
        self._timeout_s = timeout_s
        self._prefixes = tuple(resource_prefixes)
        self._clock = clock
        self.on_change = on_change
        self._client: PodResourcesClient | None = None
        self._view = AssignmentView(STATE_PENDING, None)
        self._logged_state = STATE_PENDING
        self._logged_message = ""
        self._refresh_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.refreshes = 0  # List calls made (for tests and debugging)

    def view(self) -> AssignmentView:
        """The latest state; a single attribute read, never blocks."""
        return self._view

    def refresh(self) -> AssignmentView:
        """Call List once now (the background thread does this every interval) and publish the result."""
        with self._refresh_lock:
            before = self._view.assignments
            view = self._refresh_locked()
            self._view = view
            self._log_transition(view)
        if self.on_change is not None and view.state == STATE_OK and before is not None and (
                view.assignments != before):
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - an edge read missed costs accuracy, never the refresh
                log.debug("pod-resources change listener failed", exc_info=True)
        return view

    def _refresh_locked(self) -> AssignmentView:
        last = self._view
        keep = last.assignments, last.refreshed_at
        path = self.socket_path
        try:
            os.stat(path)
            reachable = os.access(path, os.W_OK)  # connect(2) on a unix socket needs write permission
        except FileNotFoundError:
            return AssignmentView(
                STATE_SOCKET_MISSING, keep[0],
                f"kubelet pod-resources socket {path} does not exist: GPUs are not attributed to pods. "
                "On Kubernetes, mount the host directory /var/lib/kubelet/pod-resources (read-only) and "
                "point --kubernetes.pod-resources-socket at the socket; elsewhere disable "
                "--collector.kubernetes.",
                keep[1],
            )
        except PermissionError:
            reachable = False
        if not reachable:
            return AssignmentView(
                STATE_PERMISSION_DENIED, keep[0],
                f"kubelet pod-resources socket {path} exists but uid {os.getuid()} may not connect to it "
                "(the kubelet creates it for root only): GPUs are not attributed to pods. Run the "
                "exporter as uid 0 (all capabilities can stay dropped: see the pod-attribution overlay "
                "in docs/deploy.md) or disable --collector.kubernetes.",
                keep[1],
            )
        if self._client is None:
            self._client = PodResourcesClient(path, timeout_s=self._timeout_s)
        self.refreshes += 1
        try:
            response = self._client.list()
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            return AssignmentView(
                STATE_RPC_ERROR, keep[0],
                f"kubelet pod-resources List on {path} failed: "
                f"{code.name if code is not None else 'UNKNOWN'}: {details}; keeping the last known "
                "assignments",
                keep[1],
            )
        return AssignmentView(STATE_OK, parse_list_response(response, self._prefixes), "", self._clock(),
                              frozenset((p.namespace, p.name) for p in response.pod_resources))

    def _log_transition(self, view: AssignmentView) -> None:
        # One line per change of state (or of the error text), never one per refresh.
        if view.state == self._logged_state and view.message == self._logged_message:
            return
        previous = self._logged_state
        self._logged_state, self._logged_message = view.state, view.message
        if view.state == STATE_OK:
            if previous != STATE_PENDING:
                log.info("kubelet pod-resources socket %s answers again: attributing GPUs to pods",
                         self.socket_path)
            else:
                log.info("attributing GPUs to pods through the kubelet pod-resources socket %s",
                         self.socket_path)
        elif view.state == STATE_RPC_ERROR:
            log.error("%s", view.message)
        else:
            log.warning("%s", view.message)

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_interval_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - the thread must survive anything the kubelet sends
                log.exception("refreshing pod-resources assignments failed")

    def start(self) -> None:
        """Refresh once synchronously (so the first sample already has the map), then on a thread."""
        if self._thread is not None:
            return
        self.refresh()
        self._thread = threading.Thread(target=self._run, name="k8s-pod-resources", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        if self._client is not None:
            self._client.close()
            self._client = None
