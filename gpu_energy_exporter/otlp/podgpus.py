"""A pod may push only for the GPUs the kubelet gave it (docs/security.md, pods).

When a push comes from a pod (``core.clientid.Peer.pod``, found by its address: ``kubernetes.podips``), every
point whose ``gpu_uuid`` names a GPU (or MIG instance) outside the pod's devices, as the kubelet's pod-resources
API lists them, is refused (``foreign_gpu``): a pod cannot have its run charged a neighbour's GPU. A pod the
last pod-resources answer does not list yet (it just started), or no answer at all, restricts nothing: the
ledger's own checks (which process uses which GPU) still apply. Pure: no lock, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable

from gpu_energy_exporter.core.clientid import Peer
from gpu_energy_exporter.core.contract import ATTR_GPU_UUID, GPU_NONE, GPU_UNKNOWN, gpu_key
from gpu_energy_exporter.otlp.points import Batch

FOREIGN_GPU = "foreign_gpu"

#: (namespace, pod) -> the uuid keys (``gpu_key``) of the GPUs and MIG instances it holds; None: not known.
PodDevices = Callable[[str, str], "frozenset[str] | None"]

_NOT_GPUS = frozenset({"", GPU_NONE, GPU_UNKNOWN})


def restrict_to_pod(batch: Batch, peer: Peer, devices: PodDevices | None) -> None:
    """Refuse the points of ``batch`` that name a GPU ``peer``'s pod does not hold (see the module docstring)."""
    if peer.pod is None or devices is None or not batch.points:
        return
    held = devices(peer.pod[0], peer.pod[1])
    if held is None:
        return
    kept = []
    refused = 0
    first = ""
    for p in batch.points:
        label = next((v for k, v in p.labels if k == ATTR_GPU_UUID), "")
        foreign = [g for g in label.split(",") if g.strip().lower() not in _NOT_GPUS and gpu_key(g) not in held]
        if foreign:
            refused += 1
            first = first or foreign[0].strip()
        else:
            kept.append(p)
    if refused:
        batch.points = kept
        ns, pod, _ = peer.pod
        batch.reject(FOREIGN_GPU, refused,
                     f"gpu_uuid {first[:80]!r} is not one of the GPUs the kubelet gave pod {ns}/{pod}: a pod may "
                     "only report the GPUs it holds (docs/security.md)")
