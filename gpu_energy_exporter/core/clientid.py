"""Who pushed a point: the client identity the OTLP receiver gives every point and the run ledger checks a
run's lifecycle and per-client bounds against.

A client is the TCP peer's address and what the sender's resource says about the process: ``host.name``,
``process.pid`` and ``service.instance.id`` (the training helper sends all three; ``service.instance.id``
is a random UUID per process, so two processes never share an identity). ``peer_of`` is the part a sender
cannot choose (per-client bounds count by it); ``node_of`` the peer and host name (the processes of one
multi-rank job on one node share it). Nothing here is a secret: the bearer token
(``--otlp.bearer-token-file``) is what keeps strangers out; this keeps one client from ending, joining or
flooding another's runs by accident or by forging labels it read on /metrics.

Plain data: one string per client, built and split here only. Never reads a socket or a request.
"""

from __future__ import annotations

from collections.abc import Iterable

#: Resource attributes (as the receiver's sanitised labels) that identify the sending process.
HOST = "host_name"
PID = "process_pid"
INSTANCE = "service_instance_id"

_SEP = "\x1f"  # no attribute value or address carries it after translation... and if one does, it only
# makes that client's identity differ from everyone else's, never equal to another's peer


def client_id(peer: str, resource: Iterable[tuple[str, str]]) -> str:
    """The identity of a request from ``peer`` (its address, "" when unknown) whose resource has the
    (sanitised) labels ``resource``."""
    found = {HOST: "", PID: "", INSTANCE: ""}
    for key, value in resource:
        if key in found:
            found[key] = value
    if not (peer or found[HOST] or found[PID] or found[INSTANCE]):
        return ""  # anonymous: the same as a point recorded without a client
    return _SEP.join((peer.replace(_SEP, ""), found[HOST].replace(_SEP, ""), found[PID].replace(_SEP, ""),
                      found[INSTANCE]))


def peer_of(client: str) -> str:
    """The peer address part of ``client`` (what per-client bounds count by)."""
    return client.split(_SEP, 1)[0]


def node_of(client: str) -> str:
    """The peer address and host name of ``client``: the node (pod, machine) a process runs on."""
    return _SEP.join(client.split(_SEP, 2)[:2])


def describe(client: str) -> str:
    """``client`` for a log line or a note."""
    parts = (client.split(_SEP) + ["", "", "", ""])[:4]
    labels = ("peer", "host", "pid", "instance")
    return " ".join(f"{k}={v}" for k, v in zip(labels, parts, strict=True) if v) or "anonymous"
