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

Settled, not guessed (``core.settle.SpanBook``): between two reads of a GPU's energy counter each sample's
interval is a piece of the open span, split between the holders then; the counters grow only when the read
that closes the span settles its pieces (the counter's exact delta spread by the power readings' shape, each
piece split by the per-process SM samples NVML gave over it, mapped to containers through that piece's
pid -> container map). The counters therefore lag by at most one counter interval; the part not settled yet
is ``provisional`` (a gauge), replaced at the read, never added. A GPU state without a span (no counter, or
a test's) is charged each delta at once.

The map is refreshed less often than energy is sampled (``--kubernetes.refresh-interval``): a pod holds a
GPU from the refresh whose answer first lists it to the one that no longer does (``changed_at``, on the
GPU readings' clock; the collector has the energy counters read at that moment, so both edges are counter
reads). Without that time a delta is attributed to the holders known at the end of the interval. A pod
(namespace and name) that has held no GPU for ``grace_s`` seconds loses its series; if it comes back later
its counters restart from zero (a counter reset, which ``rate()`` and ``increase()`` handle).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpu_energy_exporter.collectors.kubernetes.assignments import DeviceAssignment, PodRef
from gpu_energy_exporter.core import sharing
from gpu_energy_exporter.core.settle import SpanBook, Split
from gpu_energy_exporter.core.state import GPUIdentity, GPUState

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


#: A part's owner key in the book: (container, method); ``UNOWNED`` is the GPU's unattributed energy.
Key = tuple[PodRef, str]


def pod_weights(pid_weights: Mapping[int, float], owners: Mapping[int, PodRef]) -> dict[PodRef, float] | None:
    """Per-process SM use (pid -> SM %) as per-container weights through ``owners`` (each process NVML listed
    on the GPU -> the container running it, ``UNOWNED`` for one in no holder): a listed process without a
    figure used no SMs; a process not listed is not counted (as the run ledger does). None when no holder's
    process used the SMs (the GPU is then split evenly)."""
    w: dict[PodRef, float] = defaultdict(float)
    for pid, owner in owners.items():
        sm = pid_weights.get(pid, 0.0)
        if math.isfinite(sm) and sm > 0:
            w[owner] += sm
    return dict(w) if any(v > 0 for pod, v in w.items() if pod != UNOWNED) else None


def splitter(slots: Sequence[Slot], weights: Mapping[PodRef, float] | None = None,
             owners: Mapping[int, PodRef] | None = None) -> Split[Key]:
    """``split`` of one piece of a GPU held by ``slots`` as the settlement book calls it: the per-process
    weights NVML's samples give over the piece, through ``owners`` (pid -> container); else ``weights`` (the
    last per-container weights known)."""
    held = tuple(slots)
    pods = {s.pod for s in held if not s.mig_uuid}
    if len(pods) < 2:  # one holder gets the whole GPU, whatever else runs there (exclusive)
        weights, owners = None, None
    # A process of a container that holds no slot of this piece keeps its share, as unattributed.
    mine = {pid: pod if pod in pods else UNOWNED for pid, pod in (owners or {}).items()}
    last: dict[PodRef, float] | None = None
    if weights is not None:
        last = defaultdict(float)
        for pod, v in weights.items():
            last[pod if pod in pods else UNOWNED] += v

    def parts(joules: float, pid_weights: Mapping[int, float] | None) -> list[tuple[Key, float]]:
        if not held:
            return [((UNOWNED, ""), joules)]
        w = last
        if pid_weights is not None and mine:
            w = pod_weights(pid_weights, mine)
        return [((pod, method), j) for pod, method, j in split(joules, held, w)]

    return parts


class PodEnergyAttributor:
    """Accumulates per-container energy counters from successive GPU energy readings.

    Call ``update`` once per sample with the GPUs' monotonic energy counters (joules) and the current
    holdings. Not thread-safe: one owner (the kubernetes collector, on the sampler thread).
    """

    def __init__(self, grace_s: float = 300.0) -> None:
        if grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        self._grace_s = grace_s
        self._book: SpanBook[Key] = SpanBook()
        self._held: dict[str, tuple[Slot, ...]] = {}  # the last update's holders of each GPU
        self._container: dict[tuple[PodRef, str], float] = {}
        self._pod_last_held: dict[tuple[str, str], float] = {}
        self._unattributed: dict[str, float] = {}

    def update(
        self,
        now: float,
        gpu_energy_j: Mapping[str, float],
        holdings: Mapping[str, Sequence[Slot]],
        weights: Mapping[str, Mapping[PodRef, float]] | None = None,
        *,
        states: Mapping[str, GPUState] | None = None,
        owners: Mapping[str, Mapping[int, PodRef]] | None = None,
        changed_at: float | None = None,
    ) -> None:
        """Attribute every GPU's energy since the previous update to its holders, settled at each counter
        read (module docstring).

        ``gpu_energy_j``: GPU UUID -> monotonic energy counter. A GPU missing from it (lost, not sampled)
        is skipped and its next delta covers the gap. The first reading of a GPU only sets its baseline.
        A counter that goes backwards is rebased without attributing anything.
        ``holdings``: physical GPU UUID -> slots (from ``resolve``). ``weights``: GPU UUID -> container
        -> SM utilisation, the last known, for shared GPUs. ``states``: GPU UUID -> its state (the reading's
        time and the span since its last counter read: what settles); without one a GPU's delta is charged
        at once. ``owners``: GPU UUID -> pid -> container (``UNOWNED`` for a process in no holder) of the
        processes listed now, which maps the per-process samples of this piece. ``changed_at``: when the
        holdings last changed (the readings' clock): the interval is cut there, the holders before it
        charged up to it.
        """
        for slots in holdings.values():
            for s in slots:
                self._pod_last_held[(s.pod.namespace, s.pod.pod)] = now
        for gpu_uuid, energy in gpu_energy_j.items():
            slots = tuple(holdings.get(gpu_uuid, ()))
            before = self._held.get(gpu_uuid, slots)
            self._held[gpu_uuid] = slots
            state = (states or {}).get(gpu_uuid)
            t = state.read_at if state is not None else None
            span = state.span if state is not None else None
            w, o = (weights or {}).get(gpu_uuid), (owners or {}).get(gpu_uuid)
            segments: list[tuple[float, Split[Key]]] = [(math.inf, splitter(slots, w, o))]
            if changed_at is not None and t is not None and changed_at < t and before != slots:
                segments.insert(0, (changed_at, splitter(before, w, o)))
            self._unattributed.setdefault(gpu_uuid, 0.0)  # series exist from the start
            if slots and (before != slots or gpu_uuid not in self._book.gpus()):
                for pod, method, _ in split(0.0, slots, w):  # a new holder's series exist from its first sample
                    if pod != UNOWNED:
                        self._container.setdefault((pod, method), 0.0)
            settled = self._book.update(gpu_uuid, t=t, energy_j=energy, span=span, segments=segments)
            self._charge(gpu_uuid, settled)
        self._expire(now)

    def _charge(self, gpu_uuid: str, settled: Mapping[Key, float]) -> None:
        for (pod, method), joules in settled.items():
            if pod == UNOWNED:
                self._unattributed[gpu_uuid] += joules
            elif (pod.namespace, pod.pod) in self._pod_last_held:
                # (a pod expired before its last span settled: grace shorter than the counter interval)
                key = (pod, method)
                self._container[key] = self._container.get(key, 0.0) + joules

    def _expire(self, now: float) -> None:
        gone = {k for k, t in self._pod_last_held.items() if now - t > self._grace_s}
        if not gone:
            return
        for k in gone:
            del self._pod_last_held[k]
        for key in [key for key in self._container if (key[0].namespace, key[0].pod) in gone]:
            del self._container[key]

    def container_energy(self) -> dict[tuple[PodRef, str], float]:
        """(container, method) -> joules settled, for every container whose pod has not expired."""
        return dict(self._container)

    def pod_energy(self) -> dict[tuple[str, str, str], float]:
        """(namespace, pod, method) -> joules settled: the sum over the pod's containers."""
        out: dict[tuple[str, str, str], float] = defaultdict(float)
        for (pod, method), joules in self._container.items():
            out[(pod.namespace, pod.pod, method)] += joules
        return dict(out)

    def pod_provisional(self) -> dict[tuple[str, str], float]:
        """(namespace, pod) -> joules charged to it since its GPUs' last counter reads, not settled yet (the
        power readings' estimate, split by the last weights): replaced when the next read settles them."""
        out = dict.fromkeys(self._pod_last_held, 0.0)
        for gpu in self._book.gpus():
            for (pod, _), joules in self._book.provisional(gpu).items():
                k = (pod.namespace, pod.pod)
                if pod != UNOWNED and k in self._pod_last_held:
                    out[k] = out.get(k, 0.0) + joules
        return out

    def unattributed_energy(self) -> dict[str, float]:
        """GPU UUID -> joules settled while no container held the GPU (since the first update)."""
        return dict(self._unattributed)

    def pods(self) -> set[tuple[str, str]]:
        """(namespace, pod) of every pod that still has series."""
        return set(self._pod_last_held)
