"""Per-pod and per-container GPU energy: integrate each GPU's energy deltas to the containers holding it.

Pure arithmetic: times, energy counters and the GPU to pod map come in as arguments; this module never
does I/O, never reads a clock and never imports grpc or NVML.

How one GPU's energy delta between two updates is split (the ``method`` label; the rule is
``core.sharing.split``, shared with the run ledger, mapped here onto the kubelet's slots):

- ``exclusive``: one container holds the whole GPU (``nvidia.com/gpu``). It gets all of the delta, idle
  power included: energy belongs to whoever holds the hardware.
- ``mig_slices``: the GPU is partitioned with MIG. NVML has no per-instance power, so instance energy is
  not measurable; the parent GPU's delta is split once over the MIG instances that are held, in
  proportion to their compute slices as NVML reports them (``nvmlDeviceGetAttributes_v2``, the run ledger
  weighs them the same), else as the device plugin's resource name says (``mig-3g.40gb`` weighs 3,
  ``mig-1g.10gb`` 1; a profile we cannot parse weighs 1), and evenly between containers sharing one
  instance. The parent's energy is never
  repeated per instance, so summing over pods gives the GPU's energy, not a multiple of it. Instances
  nobody holds get nothing: the held ones absorb the whole GPU's energy.
- ``sm_utilization``: several containers share one GPU (time-slicing or MPS replicas, ids
  ``GPU-...::N``) and per-process SM utilisation is known for the interval; the delta is split in
  proportion to each container's summed SM utilisation. Processes that run in no container holding the
  GPU keep their share (``UNOWNED``), which is counted as unattributed.
- ``shared_even``: shared as above without usable utilisation (not reported, or zero for everybody):
  split evenly per replica held.

Energy of a GPU that nobody holds is counted separately as unattributed, so that
``sum(pods) + unattributed == GPU energy`` over any window in which the map did not change.

The map is refreshed less often than energy is sampled (``--kubernetes.refresh-interval``); a delta is
attributed to the holders known at the end of the interval, so attribution is exact to within one refresh
interval when a pod starts or stops. A pod (namespace and name) that has held no GPU for ``grace_s``
seconds loses its series; if it comes back later its counters restart from zero (a counter reset, which
``rate()`` and ``increase()`` handle).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.state import GPUIdentity
from gpu_energy_exporter.kubernetes.assignments import DeviceAssignment, PodRef

METHOD_EXCLUSIVE = "exclusive"
METHOD_MIG_SLICES = "mig_slices"
METHOD_SM_UTILIZATION = "sm_utilization"
METHOD_SHARED_EVEN = "shared_even"
METHODS = (METHOD_EXCLUSIVE, METHOD_MIG_SLICES, METHOD_SM_UTILIZATION, METHOD_SHARED_EVEN)
#: The splitter's rule -> this series' ``method`` label (kept as they were named before the rule was shared).
_METHOD = {sharing.RULE_EXCLUSIVE: METHOD_EXCLUSIVE, sharing.RULE_MIG: METHOD_MIG_SLICES,
           sharing.RULE_SM_UTIL: METHOD_SM_UTILIZATION, sharing.RULE_EVEN: METHOD_SHARED_EVEN}

__all__ = ["UNOWNED", "DeviceAssignment", "PodEnergyAttributor", "PodRef", "Slot", "mig_slices", "resolve", "split"]

#: The owner, in ``split``'s weights and parts, of the processes on a GPU that run in none of its holders.
UNOWNED = PodRef("", "", "")

_MIG_PROFILE = re.compile(r"mig-(\d+)g\.")


@dataclass(frozen=True, order=True)
class Slot:
    """A piece of one physical GPU held by one container: the whole GPU, one replica of a shared GPU, or
    one MIG instance."""

    gpu_uuid: str  # the physical GPU (the parent for a MIG instance)
    pod: PodRef
    mig_uuid: str = ""  # "" for a whole or shared GPU
    slices: int = 1  # MIG compute slices of the instance (1 for a whole GPU)
    device_id: str = ""  # as the kubelet reported it


def mig_slices(resource_name: str) -> int:
    """Compute slices of a MIG profile from the device plugin's resource name (``mig-3g.40gb`` -> 3).

    With the device plugin's "single" MIG strategy every instance is announced as ``nvidia.com/gpu`` and
    all instances have the same profile, so the fallback weight of 1 is exact there too.
    """
    m = _MIG_PROFILE.search(resource_name)
    return max(1, int(m.group(1))) if m else 1


def resolve(
    assignments: Iterable[DeviceAssignment], gpus: Sequence[GPUIdentity]
) -> tuple[dict[str, tuple[Slot, ...]], list[str]]:
    """Turn the kubelet's device ids into slots of physical GPUs.

    Accepts the NVIDIA device plugin's id forms: GPU UUIDs, MIG UUIDs (``MIG-<uuid>`` and the pre-R470
    ``MIG-GPU-<uuid>/<gi>/<ci>``), a ``::<replica>`` suffix (time-slicing and MPS sharing), and the
    ``index`` id strategy (``"2"`` for GPU 2, ``"2:1"`` for MIG device 1 on GPU 2). Returns the slots per
    physical GPU UUID and the device ids that match no GPU of this node (sorted, for one log line).
    """
    by_uuid = {g.uuid: g for g in gpus}
    by_index = {str(g.index): g for g in gpus}
    mig_parent: dict[str, tuple[str, int]] = {}
    nvml_slices: dict[str, int] = {}  # MIG uuid -> compute slices NVML reports (the ledger uses the same)
    for g in gpus:
        for m in g.mig_devices:
            mig_parent[m.uuid] = (m.parent_uuid or g.uuid, m.index)
            if m.compute_instance_slices:
                nvml_slices[m.uuid] = m.compute_instance_slices
    holdings: dict[str, list[Slot]] = defaultdict(list)
    unresolved: set[str] = set()
    for a in assignments:
        raw = a.device_id.split("::", 1)[0].strip()
        slices = mig_slices(a.resource_name)
        slot: Slot | None = None
        if raw in by_uuid:
            slot = Slot(raw, a.pod, device_id=a.device_id)
        elif raw in mig_parent:
            slot = Slot(mig_parent[raw][0], a.pod, raw, nvml_slices.get(raw, slices), a.device_id)
        elif raw.startswith("MIG-GPU-") and raw[4:].split("/", 1)[0] in by_uuid:
            slot = Slot(raw[4:].split("/", 1)[0], a.pod, raw, slices, a.device_id)
        elif raw in by_index:
            slot = Slot(by_index[raw].uuid, a.pod, device_id=a.device_id)
        elif ":" in raw and raw.split(":", 1)[0] in by_index:
            parent_index, mig_index = raw.split(":", 1)
            parent = by_index[parent_index]
            mig = next((m for m in parent.mig_devices if str(m.index) == mig_index), None)
            if mig is not None:
                slot = Slot(parent.uuid, a.pod, mig.uuid, mig.compute_instance_slices or slices, a.device_id)
        if slot is None:
            unresolved.add(a.device_id)
        else:
            holdings[slot.gpu_uuid].append(slot)
    return {k: tuple(sorted(v)) for k, v in holdings.items()}, sorted(unresolved)


def split(
    delta_j: float, slots: Sequence[Slot], weights: Mapping[PodRef, float] | None = None
) -> list[tuple[PodRef, str, float]]:
    """Split one GPU's energy delta over the slots holding it; see the module docstring for the rules.

    The rule itself is ``core.sharing.split`` (the one the run ledger uses too); this maps slots onto it.
    ``weights`` (container -> summed SM utilisation of its processes over the interval) is used only for a
    whole GPU that several containers share; a container missing from it ran no process there (weight 0).
    The parts always sum to ``delta_j`` when ``slots`` is not empty.
    """
    if not slots:
        return []
    replicas: dict[tuple[PodRef, str], int] = defaultdict(int)
    for s in slots:
        replicas[(s.pod, s.mig_uuid)] += 1
    members = [
        sharing.Member(
            s.pod, s.mig_uuid, max(1, s.slices),
            None if weights is None else max(0.0, float(weights.get(s.pod, 0.0))) / replicas[(s.pod, s.mig_uuid)],
        )
        for s in sorted(slots)
    ]
    if weights and weights.get(UNOWNED, 0.0) > 0 and not any(s.mig_uuid for s in slots):
        # Processes on the GPU that run in no pod holding it keep their share: ``UNOWNED`` gets it, and the
        # attributor counts it as unattributed.
        members.append(sharing.Member(UNOWNED, "", 1, float(weights[UNOWNED])))
    return [(pod, _METHOD[rule], part) for pod, rule, part in sharing.split(delta_j, members)]


class PodEnergyAttributor:
    """Accumulates per-container energy counters from successive GPU energy readings.

    Call ``update`` once per sample with the GPUs' monotonic energy counters (joules) and the current
    holdings. Not thread-safe: one owner (the kubernetes collector, on the sampler thread).
    """

    def __init__(self, grace_s: float = 300.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._grace_s = grace_s
        self._last_energy: dict[str, float] = {}
        self._container: dict[tuple[PodRef, str], float] = {}
        self._pod_last_held: dict[tuple[str, str], float] = {}
        self._unattributed: dict[str, float] = {}

    def update(
        self,
        now: float,
        gpu_energy_j: Mapping[str, float],
        holdings: Mapping[str, Sequence[Slot]],
        weights: Mapping[str, Mapping[PodRef, float]] | None = None,
    ) -> None:
        """Attribute every GPU's energy since the previous update to its current holders.

        ``gpu_energy_j``: GPU UUID -> monotonic energy counter. A GPU missing from it (lost, not sampled)
        is skipped and its next delta covers the gap. The first reading of a GPU only sets its baseline.
        A counter that goes backwards is rebased without attributing anything.
        ``holdings``: physical GPU UUID -> slots (from ``resolve``). ``weights``: GPU UUID -> container
        -> SM utilisation, for shared GPUs.
        """
        for slots in holdings.values():
            for s in slots:
                self._pod_last_held[(s.pod.namespace, s.pod.pod)] = now
        for gpu_uuid, energy in gpu_energy_j.items():
            last = self._last_energy.get(gpu_uuid)
            self._last_energy[gpu_uuid] = energy
            delta = 0.0 if last is None or energy < last else energy - last
            slots = holdings.get(gpu_uuid, ())
            unattributed = self._unattributed.setdefault(gpu_uuid, 0.0)  # series exist from the start
            if not slots:
                self._unattributed[gpu_uuid] = unattributed + delta
                continue
            for pod, method, joules in split(delta, slots, (weights or {}).get(gpu_uuid)):
                if pod == UNOWNED:
                    self._unattributed[gpu_uuid] += joules
                    continue
                key = (pod, method)
                self._container[key] = self._container.get(key, 0.0) + joules
        self._expire(now)

    def _expire(self, now: float) -> None:
        gone = {k for k, t in self._pod_last_held.items() if now - t > self._grace_s}
        if not gone:
            return
        for k in gone:
            del self._pod_last_held[k]
        for key in [key for key in self._container if (key[0].namespace, key[0].pod) in gone]:
            del self._container[key]

    def container_energy(self) -> dict[tuple[PodRef, str], float]:
        """(container, method) -> joules, for every container whose pod has not expired."""
        return dict(self._container)

    def pod_energy(self) -> dict[tuple[str, str, str], float]:
        """(namespace, pod, method) -> joules: the sum over the pod's containers."""
        out: dict[tuple[str, str, str], float] = defaultdict(float)
        for (pod, method), joules in self._container.items():
            out[(pod.namespace, pod.pod, method)] += joules
        return dict(out)

    def unattributed_energy(self) -> dict[str, float]:
        """GPU UUID -> joules consumed while no container held the GPU (since the first update)."""
        return dict(self._unattributed)

    def pods(self) -> set[tuple[str, str]]:
        """(namespace, pod) of every pod that still has series."""
        return set(self._pod_last_held)
