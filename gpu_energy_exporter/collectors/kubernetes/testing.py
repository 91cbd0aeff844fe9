"""A stand-in kubelet: a real gRPC server for the pod-resources v1 API on a unix socket.

For tests and demos, in the spirit of httpx's ``MockTransport``: you set the pods, it serves ``List``
over the same wire protocol as the kubelet, and the exporter's real client talks to it. It must never be
used by the exporter itself.

    with FakeKubelet(socket_path) as kubelet:
        kubelet.set_pods([fake_pod("ml", "train-0", {"trainer": ["GPU-...", ("nvidia.com/mig-1g.10gb", "MIG-...")]})])
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from concurrent import futures
from types import TracebackType

import grpc

from gpu_energy_exporter.collectors.kubernetes import podresources_pb2 as pb
from gpu_energy_exporter.collectors.kubernetes import podresources_pb2_grpc as pb_grpc

DEFAULT_RESOURCE = "nvidia.com/gpu"


def fake_pod(
    namespace: str, name: str, containers: Mapping[str, Sequence[str | tuple[str, str]]]
) -> pb.PodResources:
    """A pod whose containers hold devices: each a device id of ``nvidia.com/gpu``, or a
    ``(resource_name, device_id)`` pair such as ``("nvidia.com/mig-1g.10gb", "MIG-...")``."""
    out = pb.PodResources(name=name, namespace=namespace)
    for cname, devices in containers.items():
        c = out.containers.add(name=cname)
        by_resource: dict[str, list[str]] = {}
        for dev in devices:
            resource, dev_id = (DEFAULT_RESOURCE, dev) if isinstance(dev, str) else dev
            by_resource.setdefault(resource, []).append(dev_id)
        for resource, dev_ids in by_resource.items():
            c.devices.add(resource_name=resource, device_ids=dev_ids)
        c.cpu_ids.extend([0, 1])  # the kubelet reports CPUs too; the client must ignore them
    return out


class _Servicer(pb_grpc.PodResourcesListerServicer):
    def __init__(self, owner: FakeKubelet) -> None:
        self._owner = owner

    def List(  # noqa: N802 - gRPC method name
        self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pb.ListPodResourcesResponse:
        return self._owner._list(context)


class FakeKubelet:
    """Serves ``PodResourcesLister.List`` on ``socket_path`` until ``stop``. ``calls`` counts requests;
    ``fail_with`` makes List abort with that status code (``None`` to answer again); ``delay_s`` makes it
    answer late, like a kubelet under load."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.calls = 0
        self.fail_with: grpc.StatusCode | None = None
        self.delay_s = 0.0
        self._stopping = threading.Event()
        self._pods: tuple[pb.PodResources, ...] = ()
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def set_pods(self, pods: Sequence[pb.PodResources]) -> None:
        with self._lock:
            self._pods = tuple(pods)

    def _list(self, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        with self._lock:
            self.calls += 1
            fail, pods, delay = self.fail_with, self._pods, self.delay_s
        if delay:
            self._stopping.wait(delay)
        if fail is not None:
            context.abort(fail, "fake kubelet told to fail")
        return pb.ListPodResourcesResponse(pod_resources=list(pods))

    def start(self) -> FakeKubelet:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(_Servicer(self), server)
        if server.add_insecure_port("unix://" + os.path.abspath(self.socket_path)) == 0:
            raise OSError(f"cannot listen on unix socket {self.socket_path}")
        server.start()
        self._stopping.clear()
        self._server = server
        return self

    def stop(self) -> None:
        """Stop serving and remove the socket, as a kubelet that goes away does."""
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace=None).wait(5.0)
            self._server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> FakeKubelet:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
