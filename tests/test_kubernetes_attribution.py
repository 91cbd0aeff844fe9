"""Pure attribution arithmetic: device id resolution, the split rules, integration, expiry."""

from __future__ import annotations

import random

import pytest

from gpu_energy_exporter.collectors.kubernetes.assignments import DeviceAssignment, PodRef
from gpu_energy_exporter.collectors.kubernetes.attribution import (
    METHOD_EXCLUSIVE,
    METHOD_MIG_SLICES,
    METHOD_SHARED_EVEN,
    METHOD_SM_UTILIZATION,
    PodEnergyAttributor,
    Slot,
    mig_slices,
    resolve,
    split,
)
from gpu_energy_exporter.core.state import GPUIdentity, MIGDevice

U0, U1, U2 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111", \
    "GPU-22222222-2222-2222-2222-222222222222"
M20, M21, M22 = "MIG-aaaaaaaa-0000", "MIG-aaaaaaaa-0001", "MIG-aaaaaaaa-0002"


def gpu(index: int, uuid: str, migs: tuple[str, ...] = ()) -> GPUIdentity:
    return GPUIdentity(
        index=index, uuid=uuid, name="NVIDIA Fake", pci_bus_id=f"00000000:{index:02x}:00.0",
        architecture="hopper", compute_capability="9.0", energy_method="counter",
        power_usage_is_average=True, mig_enabled=bool(migs),
        mig_devices=tuple(MIGDevice(m, uuid, i) for i, m in enumerate(migs)),
    )


GPUS = [gpu(0, U0), gpu(1, U1), gpu(2, U2, (M20, M21, M22))]
A = PodRef("ml", "train-a", "trainer")
A2 = PodRef("ml", "train-a", "sidecar")
B = PodRef("ml", "train-b", "trainer")
C = PodRef("research", "notebook", "jupyter")


def assign(pod: PodRef, device: str, resource: str = "nvidia.com/gpu") -> DeviceAssignment:
    return DeviceAssignment(pod, resource, device)


# ---- resolve ---------------------------------------------------------------------------------------------


def test_resolve_accepts_every_device_plugin_id_form() -> None:
    holdings, unresolved = resolve(
        [
            assign(A, U0),
            assign(B, U1 + "::0", "nvidia.com/gpu.shared"),  # time-slicing replica
            assign(C, U1 + "::3", "nvidia.com/gpu.shared"),
            assign(A2, M21, "nvidia.com/mig-3g.40gb"),
            assign(B, "MIG-" + U2 + "/1/0", "nvidia.com/mig-1g.10gb"),  # pre-R470 MIG id
            assign(C, "2:2", "nvidia.com/mig-2g.20gb"),  # index strategy, MIG
            assign(C, "0"),  # index strategy, whole GPU
            assign(C, "GPU-ffffffff-not-on-this-node"),
            assign(C, "7:0", "nvidia.com/mig-1g.10gb"),
        ],
        GPUS,
    )
    assert unresolved == ["7:0", "GPU-ffffffff-not-on-this-node"]
    assert holdings[U0] == tuple(sorted([Slot(U0, A, device_id=U0), Slot(U0, C, device_id="0")]))
    assert [s.pod for s in holdings[U1]] == [B, C]
    assert all(s.mig_uuid == "" for s in holdings[U1])
    by_pod = {s.pod: s for s in holdings[U2]}
    assert by_pod[A2] == Slot(U2, A2, M21, 3, M21)
    assert by_pod[B].mig_uuid == "MIG-" + U2 + "/1/0" and by_pod[B].slices == 1
    assert by_pod[C] == Slot(U2, C, M22, 2, "2:2")


@pytest.mark.parametrize(
    ("resource", "slices"),
    [("nvidia.com/mig-1g.10gb", 1), ("nvidia.com/mig-3g.40gb", 3), ("nvidia.com/mig-7g.80gb", 7),
     ("nvidia.com/mig-1g.10gb+me", 1), ("nvidia.com/gpu", 1), ("nvidia.com/mig-weird", 1)],
)
def test_mig_slices_from_resource_name(resource: str, slices: int) -> None:
    assert mig_slices(resource) == slices


# ---- split -----------------------------------------------------------------------------------------------


def test_whole_gpu_goes_to_its_one_container_even_with_several_replicas() -> None:
    assert split(10.0, [Slot(U0, A)]) == [(A, METHOD_EXCLUSIVE, 10.0)]
    # One container holding two replicas of the same GPU still holds it alone.
    assert split(10.0, [Slot(U1, A, device_id="x::0"), Slot(U1, A, device_id="x::1")]) == [
        (A, METHOD_EXCLUSIVE, 10.0)
    ]


def test_shared_gpu_split_by_sm_utilisation_else_evenly_per_replica() -> None:
    slots = [Slot(U1, A, device_id="::0"), Slot(U1, A, device_id="::1"), Slot(U1, B, device_id="::2")]
    assert split(90.0, slots, {A: 20.0, B: 70.0, C: 999.0}) == [
        (A, METHOD_SM_UTILIZATION, 20.0), (B, METHOD_SM_UTILIZATION, 70.0),
    ]
    even = split(90.0, slots)  # no utilisation: by replicas held, A has 2 of 3
    assert even == [(A, METHOD_SHARED_EVEN, 60.0), (B, METHOD_SHARED_EVEN, 30.0)]
    assert split(90.0, slots, {A: 0.0, B: 0.0}) == even  # idle interval: nobody to weigh by
    # A pod missing from the utilisation table ran nothing: it gets no share of this interval.
    assert split(90.0, slots, {B: 5.0}) == [(A, METHOD_SM_UTILIZATION, 0.0), (B, METHOD_SM_UTILIZATION, 90.0)]


def test_mig_energy_split_by_held_slices_never_repeated_per_instance() -> None:
    slots = [Slot(U2, A, M20, 3), Slot(U2, B, M21, 1), Slot(U2, C, M22, 2)]
    parts = split(60.0, slots, {A: 100.0})  # utilisation is ignored on MIG
    assert parts == [(A, METHOD_MIG_SLICES, 30.0), (B, METHOD_MIG_SLICES, 10.0), (C, METHOD_MIG_SLICES, 20.0)]
    assert sum(j for _, _, j in parts) == pytest.approx(60.0)  # the incumbent would report 180
    # Two containers time-sharing one instance split that instance's part evenly.
    shared = split(40.0, [Slot(U2, A, M20, 3), Slot(U2, B, M21, 1), Slot(U2, C, M21, 1)])
    assert shared == [(A, METHOD_MIG_SLICES, 30.0), (B, METHOD_MIG_SLICES, 5.0), (C, METHOD_MIG_SLICES, 5.0)]


def test_split_of_nobody_is_nothing() -> None:
    assert split(5.0, []) == []


# ---- the attributor over time ----------------------------------------------------------------------------


def energy_of(att: PodEnergyAttributor) -> dict[tuple[PodRef, str], float]:
    return {k: round(v, 9) for k, v in att.container_energy().items()}


def test_integrates_deltas_while_pods_hold_gpus_and_gpus_move_between_pods() -> None:
    att = PodEnergyAttributor(grace_s=60.0)
    att.update(0.0, {U0: 1000.0, U1: 5000.0}, {U0: (Slot(U0, A),)})  # baseline only
    assert energy_of(att) == {(A, METHOD_EXCLUSIVE): 0.0}  # the series exists from the start
    att.update(1.0, {U0: 1300.0, U1: 5100.0}, {U0: (Slot(U0, A),)})
    # A's GPU moves: now B holds U0 and A holds U1.
    att.update(2.0, {U0: 1400.0, U1: 5600.0}, {U0: (Slot(U0, B),), U1: (Slot(U1, A),)})
    assert energy_of(att) == {(A, METHOD_EXCLUSIVE): 800.0, (B, METHOD_EXCLUSIVE): 100.0}
    assert att.unattributed_energy() == {U0: 0.0, U1: 100.0}


def test_pod_energy_sums_its_containers_per_method() -> None:
    att = PodEnergyAttributor()
    holdings = {U0: (Slot(U0, A),), U1: (Slot(U1, A2),), U2: (Slot(U2, A, M20, 3), Slot(U2, B, M21, 1))}
    att.update(0.0, {U0: 0.0, U1: 0.0, U2: 0.0}, holdings)
    att.update(1.0, {U0: 10.0, U1: 20.0, U2: 40.0}, holdings)
    assert att.pod_energy() == {
        ("ml", "train-a", METHOD_EXCLUSIVE): pytest.approx(30.0),
        ("ml", "train-a", METHOD_MIG_SLICES): pytest.approx(30.0),
        ("ml", "train-b", METHOD_MIG_SLICES): pytest.approx(10.0),
    }


def test_counter_going_backwards_is_rebased_not_attributed() -> None:
    att = PodEnergyAttributor()
    h = {U0: (Slot(U0, A),)}
    att.update(0.0, {U0: 100.0}, h)
    att.update(1.0, {U0: 150.0}, h)
    att.update(2.0, {U0: 10.0}, h)  # never from a monotonic counter, but must not go negative
    att.update(3.0, {U0: 30.0}, h)
    assert energy_of(att) == {(A, METHOD_EXCLUSIVE): 70.0}


def test_missing_gpu_reading_is_covered_by_the_next_delta() -> None:
    att = PodEnergyAttributor()
    h = {U0: (Slot(U0, A),)}
    att.update(0.0, {U0: 0.0}, h)
    att.update(1.0, {}, h)  # GPU not sampled (lost for a moment)
    att.update(2.0, {U0: 42.0}, h)
    assert energy_of(att) == {(A, METHOD_EXCLUSIVE): 42.0}


def test_pods_that_are_gone_expire_after_the_grace_period_and_restart_from_zero() -> None:
    att = PodEnergyAttributor(grace_s=30.0)
    att.update(0.0, {U0: 0.0}, {U0: (Slot(U0, A), Slot(U0, A2))})
    att.update(10.0, {U0: 100.0}, {U0: (Slot(U0, A), Slot(U0, A2))})
    att.update(20.0, {U0: 150.0}, {})  # pod gone: counters stay, energy is unattributed
    assert energy_of(att) == {(A, METHOD_SHARED_EVEN): 50.0, (A2, METHOD_SHARED_EVEN): 50.0}
    att.update(40.0, {U0: 160.0}, {})  # 30 s after it last held the GPU: still within grace
    assert att.pods() == {("ml", "train-a")}
    att.update(40.5, {U0: 161.0}, {})
    assert energy_of(att) == {} and att.pods() == set() and att.pod_energy() == {}
    assert att.unattributed_energy() == {U0: pytest.approx(61.0)}
    att.update(50.0, {U0: 170.0}, {U0: (Slot(U0, A),)})  # same name again: a new pod, from zero
    assert energy_of(att) == {(A, METHOD_EXCLUSIVE): 9.0}


def test_negative_grace_is_rejected() -> None:
    with pytest.raises(ValueError, match="grace_s"):
        PodEnergyAttributor(grace_s=-1)


def test_random_histories_conserve_energy() -> None:
    """Whatever the assignments do, pods + unattributed == GPU energy, and counters never decrease."""
    rng = random.Random(1234)
    pods = [PodRef("ns", f"p{i}", c) for i in range(4) for c in ("a", "b")]
    att = PodEnergyAttributor(grace_s=1e9)
    energy = {U0: 0.0, U1: 0.0, U2: 0.0}
    first: dict[str, float] = {}
    previous: dict[tuple[str, str, str], float] = {}
    for step in range(300):
        for u in energy:
            energy[u] += rng.uniform(0.0, 700.0)
        holdings: dict[str, tuple[Slot, ...]] = {}
        for u in (U0, U1):
            holders = rng.sample(pods, rng.randint(0, 3))
            holdings[u] = tuple(Slot(u, p, device_id=f"{u}::{i}") for i, p in enumerate(holders))
        migs = rng.sample([(M20, 3), (M21, 2), (M22, 1)], rng.randint(0, 3))
        holdings[U2] = tuple(Slot(U2, rng.choice(pods), m, k) for m, k in migs)
        weights = {U1: {p: rng.uniform(0, 100) for p in pods[:3]}} if step % 2 else None
        att.update(float(step), energy, holdings, weights)
        first = first or dict(energy)  # the first update only sets the baselines
        current = att.pod_energy()
        assert all(current[k] >= v - 1e-9 for k, v in previous.items())
        previous = current
    total = sum(att.pod_energy().values()) + sum(att.unattributed_energy().values())
    assert total == pytest.approx(sum(energy.values()) - sum(first.values()), rel=1e-9)
    assert {m for (_, _, m) in att.pod_energy()} == {
        METHOD_EXCLUSIVE, METHOD_MIG_SLICES, METHOD_SM_UTILIZATION, METHOD_SHARED_EVEN
    }
