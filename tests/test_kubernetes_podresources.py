"""The kubelet pod-resources client against a real gRPC server on a unix socket (``FakeKubelet``)."""

from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from gpu_energy_exporter.collectors.kubernetes import podresources_pb2 as pb
from gpu_energy_exporter.collectors.kubernetes.assignments import (
    STATE_OK,
    STATE_PERMISSION_DENIED,
    STATE_RPC_ERROR,
    STATE_SOCKET_MISSING,
    DeviceAssignment,
    PodRef,
)
from gpu_energy_exporter.collectors.kubernetes.podresources import PodResourcesWatcher, parse_list_response
from gpu_energy_exporter.collectors.kubernetes.testing import FakeKubelet, fake_pod

REPO = Path(__file__).resolve().parent.parent
PROTO = "gpu_energy_exporter/collectors/kubernetes/podresources.proto"
G0, G1 = "GPU-0b1c2d3e-0000-0000-0000-000000000000", "GPU-0b1c2d3e-1111-1111-1111-111111111111"
MIG = "MIG-5f6e7d8c-0000-0000-0000-000000000000"
LOG = "gpu_energy_exporter.collectors.kubernetes.podresources"


@pytest.fixture
def socket_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    # Unix socket paths are limited to 107 bytes: a short directory, not the test's long tmp_path.
    return str(tmp_path_factory.mktemp("kl") / "kubelet.sock")


@pytest.fixture
def kubelet(socket_path: str) -> Iterator[FakeKubelet]:
    with FakeKubelet(socket_path) as k:
        yield k


@pytest.fixture
def watcher(socket_path: str) -> Iterator[PodResourcesWatcher]:
    w = PodResourcesWatcher(socket_path, refresh_interval_s=3600, timeout_s=2.0)
    yield w
    w.close()


def records(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOG and r.levelno == level]


def test_committed_code_is_generated_from_the_committed_proto(tmp_path: Path) -> None:
    """The generated module describes exactly the .proto next to it (compared as descriptors, so the test
    does not depend on the grpcio-tools version), and speaks the kubelet's method path."""
    from grpc_tools import protoc

    out = tmp_path / "set.pb"
    assert protoc.main(["protoc", "-I.", f"--descriptor_set_out={out}", PROTO]) == 0 or pytest.fail(
        "protoc failed"
    )
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in fresh.message_type:  # protoc adds json names; the embedded descriptor leaves them out
        for f in message.field:
            f.ClearField("json_name")
    committed = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(committed)
    assert committed == fresh
    assert committed.package == "v1"
    service = pb.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert service.methods_by_name["List"].output_type.full_name == "v1.ListPodResourcesResponse"


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # protoc -I. resolves the proto from the repository root


def test_parse_keeps_only_nvidia_devices() -> None:
    response = pb.ListPodResourcesResponse(pod_resources=[
        fake_pod("ml", "train-0", {"trainer": [G0, ("example.com/fpga", "fpga-1")], "sidecar": []}),
        fake_pod("ml", "mig-0", {"main": [("nvidia.com/mig-1g.10gb", MIG)]}),
    ])
    assert parse_list_response(response) == (
        DeviceAssignment(PodRef("ml", "train-0", "trainer"), "nvidia.com/gpu", G0),
        DeviceAssignment(PodRef("ml", "mig-0", "main"), "nvidia.com/mig-1g.10gb", MIG),
    )
    assert len(parse_list_response(response, ("example.com/",))) == 1


def test_list_over_the_unix_socket(kubelet: FakeKubelet, watcher: PodResourcesWatcher,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOG)
    kubelet.set_pods([fake_pod("ml", "train-0", {"trainer": [G0, G1]})])
    view = watcher.refresh()
    assert view.state == STATE_OK and view.message == ""
    assert view.assignments == (
        DeviceAssignment(PodRef("ml", "train-0", "trainer"), "nvidia.com/gpu", G0),
        DeviceAssignment(PodRef("ml", "train-0", "trainer"), "nvidia.com/gpu", G1),
    )
    assert watcher.view() is view and kubelet.calls == 1
    kubelet.set_pods([])
    assert watcher.refresh().assignments == ()
    assert len(records(caplog, logging.INFO)) == 1  # "attributing ...", once


def test_refreshes_on_its_own_thread_never_per_read(kubelet: FakeKubelet, socket_path: str) -> None:
    kubelet.set_pods([fake_pod("ml", "a", {"c": [G0]})])
    w = PodResourcesWatcher(socket_path, refresh_interval_s=0.1, timeout_s=2.0)
    try:
        w.start()
        assert kubelet.calls == 1 and w.view().state == STATE_OK  # the first answer is there at once
        calls, start = kubelet.calls, time.monotonic()
        for _ in range(10_000):
            w.view()
        elapsed = time.monotonic() - start
        assert kubelet.calls - calls <= elapsed / 0.1 + 1  # reading never calls the kubelet, the timer does
        kubelet.set_pods([fake_pod("ml", "b", {"c": [G1]})])
        deadline = time.monotonic() + 10
        while (w.view().assignments or (None,))[0] != DeviceAssignment(PodRef("ml", "b", "c"),
                                                                     "nvidia.com/gpu", G1):
            assert time.monotonic() < deadline, "the thread never refreshed"
            time.sleep(0.02)
    finally:
        w.close()
    calls = kubelet.calls
    time.sleep(0.3)
    assert kubelet.calls == calls  # close() stopped the thread


def test_missing_socket_is_one_clear_log_line_then_recovers(
    socket_path: str, watcher: PodResourcesWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG)
    for _ in range(5):
        view = watcher.refresh()
    assert view.state == STATE_SOCKET_MISSING and view.assignments is None
    warnings = records(caplog, logging.WARNING)
    assert len(warnings) == 1
    assert socket_path in warnings[0] and "does not exist" in warnings[0]
    assert "/var/lib/kubelet/pod-resources" in warnings[0]  # says what to do
    assert watcher.refreshes == 0  # no gRPC call without a socket
    with FakeKubelet(socket_path) as k:
        k.set_pods([fake_pod("ml", "a", {"c": [G0]})])
        assert watcher.refresh().state == STATE_OK
    assert len(records(caplog, logging.WARNING)) == 1
    assert any("answers again" in m for m in records(caplog, logging.INFO))


def test_failing_list_keeps_the_last_assignments_and_logs_once(
    kubelet: FakeKubelet, watcher: PodResourcesWatcher, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOG)
    kubelet.set_pods([fake_pod("ml", "a", {"c": [G0]})])
    good = watcher.refresh()
    kubelet.fail_with = grpc.StatusCode.UNAVAILABLE
    for _ in range(3):
        view = watcher.refresh()
    assert view.state == STATE_RPC_ERROR
    assert view.assignments == good.assignments and view.refreshed_at == good.refreshed_at
    assert "UNAVAILABLE" in view.message
    assert len(records(caplog, logging.ERROR)) == 1
    kubelet.fail_with = None
    assert watcher.refresh().state == STATE_OK


def test_a_hung_kubelet_costs_at_most_the_timeout(kubelet: FakeKubelet, socket_path: str) -> None:
    kubelet.delay_s = 30.0
    w = PodResourcesWatcher(socket_path, refresh_interval_s=3600, timeout_s=0.3)
    try:
        start = time.monotonic()
        view = w.refresh()
        assert time.monotonic() - start < 5.0
        assert view.state == STATE_RPC_ERROR and "DEADLINE_EXCEEDED" in view.message
    finally:
        w.close()


def test_kubelet_restart_new_socket_same_path(socket_path: str, watcher: PodResourcesWatcher) -> None:
    with FakeKubelet(socket_path) as k:
        k.set_pods([fake_pod("ml", "a", {"c": [G0]})])
        assert watcher.refresh().state == STATE_OK
    gone = watcher.refresh()  # the socket was removed with the kubelet
    assert gone.state == STATE_SOCKET_MISSING and gone.assignments is not None  # pods keep their GPUs
    with FakeKubelet(socket_path) as k:
        k.set_pods([fake_pod("ml", "b", {"c": [G1]})])
        view = watcher.refresh()
    assert view.state == STATE_OK
    assert view.assignments == (DeviceAssignment(PodRef("ml", "b", "c"), "nvidia.com/gpu", G1),)


def test_socket_this_user_may_not_use_is_a_clear_message_not_an_rpc_error(socket_path: str) -> None:
    """The kubelet creates the socket for root only; a non-root exporter must say so and what to do."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)  # a plain socket: the watcher must give up before any gRPC call
    listener.listen(1)
    os.chmod(socket_path, 0o755)  # as the kubelet leaves it: root may connect, nobody else
    os.chmod(os.path.dirname(socket_path), 0o755)
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only reads
        pid = os.fork()
    if pid == 0:  # child: become an ordinary user, then ask
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            else:
                os.chmod(socket_path, 0o000)
            w = PodResourcesWatcher(socket_path)
            v = w.refresh()
            os.write(write_end, f"{v.state}\n{v.message}\n{w.refreshes}".encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as f:
        state, message, refreshes = f.read().split("\n")
    os.waitpid(pid, 0)
    listener.close()
    assert state == STATE_PERMISSION_DENIED
    assert "may not connect" in message and "uid 0" in message and "--collector.kubernetes" in message
    assert refreshes == "0"
