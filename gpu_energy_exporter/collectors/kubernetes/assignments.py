"""Plain data shared by the pod-resources client, the attribution arithmetic and the collector.

No I/O and no grpc here, so the collector and the attribution can be imported (and type-checked)
without the ``[kubernetes]`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_OK = "ok"
STATE_PENDING = "pending"  # no refresh has finished yet
STATE_SOCKET_MISSING = "socket_missing"
STATE_PERMISSION_DENIED = "permission_denied"
STATE_RPC_ERROR = "rpc_error"


@dataclass(frozen=True, order=True)
class PodRef:
    """One container of one pod, as the kubelet names it."""

    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class DeviceAssignment:
    """One device id that the kubelet gave to one container, as reported (not yet resolved)."""

    pod: PodRef
    resource_name: str  # "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared", ...
    device_id: str  # "GPU-<uuid>", "MIG-<uuid>", "GPU-<uuid>::3", "0", "0:1", ...


@dataclass(frozen=True)
class AssignmentView:
    """What the watcher knows now. ``assignments`` is the last good answer (None before the first one);
    it is kept while the kubelet is unreachable, because pods keep their devices when the kubelet
    restarts."""

    state: str  # one of STATE_*
    assignments: tuple[DeviceAssignment, ...] | None
    message: str = ""  # human-readable cause when state is not ok
    refreshed_at: float | None = None  # the watcher's clock() at the last good answer
    #: every (namespace, pod) the last good answer listed, with devices or not (None: no answer yet)
    pods: frozenset[tuple[str, str]] | None = None
