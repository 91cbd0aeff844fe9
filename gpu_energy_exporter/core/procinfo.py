"""What a process's ``/proc`` entries say about where it runs: its pid in every pid namespace (``status``'s
``NSpid`` line) and its container and pod (``cgroup``). Pure parsing of text already read.

Both sides use it: the exporter reads ``<procfs>/<host pid>/status`` and ``cgroup`` for each process NVML
lists (NVML reports host pids), and the training helper reads its own ``/proc/self/cgroup`` to send its
container id with its pid. A pid inside a container is only comparable with the innermost ``NSpid`` entry,
and only within the same container: that is what ``ProcessIdentity.matches`` checks.

This module never opens a file, never reads a clock and imports nothing of the package.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# kubepods/.../pod<uid>/... (cgroupfs driver) or kubepods-...-pod<uid with _>.slice (systemd driver)
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
# docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, /docker/<id>, /kubepods/.../<id>
_CONTAINER_ID = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])")

__all__ = ["ProcessIdentity", "parse_cgroup", "parse_nspid"]


def parse_nspid(status_text: str) -> tuple[int, ...]:
    """The ``NSpid`` line of ``/proc/<pid>/status``: the pid in each pid namespace, outermost (the procfs
    mount's namespace) first, innermost last. () when the line is missing (kernels before 4.1) or broken."""
    for line in status_text.splitlines():
        if line.startswith("NSpid:"):
            try:
                return tuple(int(x) for x in line[6:].split())
            except ValueError:
                return ()
    return ()


def parse_cgroup(cgroup_text: str) -> tuple[str, str]:
    """(pod UID, container id) from ``/proc/<pid>/cgroup`` ("" where the paths say none: a process on the
    host, or a container with a private cgroup namespace, whose paths read ``0::/``)."""
    pod = container = ""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        if not pod:
            m = _POD_UID.search(path)
            if m:
                pod = m.group(1).replace("_", "-")
        if not container:
            ids = _CONTAINER_ID.findall(path)
            if ids:
                container = ids[-1]
    return pod, container


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """A process as the exporter sees it through the host's ``/proc``: ``pid`` as NVML lists it (the host's
    pid namespace), ``ns_pids`` from ``NSpid`` (outermost first), its container and pod ("" unknown)."""

    pid: int
    ns_pids: tuple[int, ...] = ()
    container_id: str = ""
    pod_uid: str = ""

    def matches(self, pid: int, container_id: str = "", pod_uid: str = "") -> bool:
        """Whether a trainer that says it is ``pid`` (in its own pid namespace) in ``container_id`` /
        ``pod_uid`` ("" when it could not tell) is this process. Same namespace: the pids are equal. In a
        container: the innermost ``NSpid`` entry is equal and the container (or pod) does not disagree, so a
        pid 1 in one container is never another container's pid 1."""
        if pod_uid and self.pod_uid and pod_uid != self.pod_uid:
            return False  # another pod's process, whatever the pids (a pod's uid is the pusher's own: Peer.pod)
        if pid == self.pid and (not container_id or not self.container_id or container_id == self.container_id):
            return True
        if len(self.ns_pids) < 2 or pid != self.ns_pids[-1]:
            return False
        if container_id and self.container_id:
            return container_id == self.container_id
        if pod_uid and self.pod_uid:
            return pod_uid == self.pod_uid
        # Neither side can name its container: the innermost pid alone, which the caller must find unique.
        return True
