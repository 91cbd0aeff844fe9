"""The one-time move of a previous release's journal (a pickle, up to release 450c1b4) into the database.

Runs once per state directory, when the ledger opens its database there and finds ``journal-*.log`` files
(``journal.legacy_journal``) and no record of a migration: only from a directory that passed
``ledger.trust``, and never again after (the journal files are renamed ``*.migrated``). The journal's last
complete record is read with ``RestrictedUnpickler``: a ``pickle.Unpickler`` whose ``find_class`` gives only
inert stand-ins for the ledger's own classes (``KNOWN``) and the few builtins a journal uses (``deque``,
``set``, ``frozenset``), and refuses any other global, so a planted record cannot run code: nothing it names
is ever called, and no class of the package is instantiated by the unpickler. The stand-ins are then turned
into the codec's tagged data (``ledger.codec``), field by field by name (by the release's own field order for
frozen dataclasses, which pickle positionally: ``LAYOUTS``), and decoded like a database record, so fields
added since take their defaults.

Pure but for reading the journal file; the store writes the result (``ledger.store``).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from gpu_energy_exporter.core.clientid import client_id, parse_ip
from gpu_energy_exporter.ledger import codec
from gpu_energy_exporter.ledger.journal import FORMAT, last_record
from gpu_energy_exporter.ledger.runs import Run

_P = "gpu_energy_exporter."

#: The classes a journal of the previous releases holds: (module, name) -> the class's name in this release
#: (``module:qualname``, resolved by ``codec``), or "" for ``Row``, which is not decoded as an object.
KNOWN: dict[tuple[str, str], str] = {
    (_P + "ledger.journal", "SteadyClock"): _P + "ledger.journal:SteadyClock",
    (_P + "ledger.runs", "Run"): _P + "ledger.runs:Run",
    (_P + "ledger.runs", "SeriesState"): _P + "ledger.series_state:SeriesState",  # 450c1b4's place
    (_P + "ledger.series_state", "SeriesState"): _P + "ledger.series_state:SeriesState",  # main's journal after it
    (_P + "ledger.accounting", "Acc"): _P + "ledger.accounting:Acc",
    (_P + "ledger.accounting", "Timeline"): _P + "ledger.accounting:Timeline",
    (_P + "ledger.frames", "Frame"): _P + "ledger.snapshot_frames:Frame",  # the pickle releases' place
    (_P + "ledger.frames", "GPUFrame"): _P + "ledger.snapshot_frames:GPUFrame",
    (_P + "ledger.frames", "SpanFrame"): _P + "ledger.snapshot_frames:SpanFrame",
    (_P + "ledger.snapshot_frames", "Frame"): _P + "ledger.snapshot_frames:Frame",  # since issue 32's renames
    (_P + "ledger.snapshot_frames", "GPUFrame"): _P + "ledger.snapshot_frames:GPUFrame",
    (_P + "ledger.snapshot_frames", "SpanFrame"): _P + "ledger.snapshot_frames:SpanFrame",
    (_P + "ledger.split", "Proc"): _P + "ledger.split:Proc",
    (_P + "ledger.split", "Holding"): _P + "ledger.split:Holding",
    (_P + "core.procinfo", "ProcessIdentity"): _P + "core.procinfo:ProcessIdentity",
    (_P + "core.health", "XidEvent"): _P + "core.health:XidEvent",
    (_P + "ledger.filewriter", "Row"): "",
}

#: Frozen slotted dataclasses are pickled as a list of their field values, in the order of their fields then:
#: the order at release 450c1b4 (fields added since came after these, and any later one is appended after).
LAYOUTS: dict[str, tuple[str, ...]] = {
    "Frame": ("t", "gpus", "mig_parent", "intensity", "pue", "host_available", "xid_events", "mig_profile", "age"),
    "GPUFrame": ("uuid", "name", "energy_j", "power_w", "memory_used", "memory_total", "idle_w", "idle_source",
                 "index", "procs"),
    "Proc": ("pid", "sm", "host", "unit", "slices"),
    "Holding": ("run_id", "start", "end", "mig_uuid", "slices", "pids", "grace_end", "has_pid", "allocated"),
    "ProcessIdentity": ("pid", "ns_pids", "container_id", "pod_uid"),
}

_BUILTINS: dict[tuple[str, str], Any] = {
    ("collections", "deque"): deque, ("builtins", "set"): set, ("builtins", "frozenset"): frozenset,
}


class MigrationError(Exception):
    """The journal could not be migrated (the message says why)."""


class _Standin:
    """What the unpickler makes of a ledger class: its constructor arguments and state, nothing run."""

    __slots__ = ("args", "state")
    key: tuple[str, str] = ("", "")
    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **_kw: Any) -> _Standin:
        obj = object.__new__(cls)
        obj.args = args
        obj.state = None
        return obj

    def __init__(self, *_args: Any, **_kw: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


_STANDINS: dict[tuple[str, str], type] = {
    key: type("Standin_" + key[1], (_Standin,), {"__slots__": (), "key": key}) for key in KNOWN
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only the journal's known classes (as stand-ins) and builtins; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _STANDINS:
            return _STANDINS[key]
        if key in _BUILTINS:
            return _BUILTINS[key]
        raise pickle.UnpicklingError(f"the journal names {module}.{name}, which no ledger journal holds: refused, "
                                     "nothing in the record was run")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("the journal uses persistent ids, which no ledger journal does: refused")


def restricted_loads(payload: bytes) -> Any:
    return RestrictedUnpickler(io.BytesIO(payload)).load()


@dataclass
class Legacy:
    """What a previous release's journal held, decoded: the runs going, the rows not written yet (summary,
    document, JSON file name, start), the last snapshot, the clock and counters."""

    path: str
    active: list[Any] = field(default_factory=list)
    pending: list[dict[str, Any]] = field(default_factory=list)
    frame: Any = None
    clock: Any = None
    seq: int = 0
    finished_counts: dict[str, float] = field(default_factory=dict)
    saved_wall: float | None = None
    problems: list[str] = field(default_factory=list)  # fields that took their defaults
    lost: list[tuple[str | None, str]] = field(default_factory=list)  # (run id if known, what) did not decode


def read(path: str) -> Legacy:
    """The last complete record of the journal file ``path``, decoded. MigrationError when there is none or
    it is not a journal of the ledger."""
    try:
        payload, _ = last_record(path)
    except OSError as exc:
        raise MigrationError(f"cannot read {path} ({exc.strerror or exc})") from None
    if payload is None:
        raise MigrationError(f"{path} holds no complete record")
    try:
        state = restricted_loads(payload)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes: refused, reported, never run
        raise MigrationError(f"{path}: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise MigrationError(f"{path} is not a ledger journal of a known format")
    out = Legacy(path)
    report = codec.Decoded()
    for item in _items(state.get("active")):
        try:
            run = codec.decode(to_tree(item), report)
        except codec.DecodeError as exc:
            out.lost.append((_run_id(item), f"its open state did not migrate ({exc})"))
            continue
        if isinstance(run, Run):
            legacy_owners(run)
        out.active.append(run)
    for item in _items(state.get("pending")):
        try:
            out.pending.append(_row(item, report))
        except codec.DecodeError as exc:
            out.lost.append((_run_id(item), f"its finished row did not migrate ({exc})"))
    for name in ("frame", "clock"):
        if state.get(name) is not None:
            try:
                setattr(out, name, codec.decode(to_tree(state[name]), report))
            except codec.DecodeError as exc:
                out.problems.append(f"{name} ({exc})")
    seq = state.get("seq")
    out.seq = seq if isinstance(seq, int) else 0
    counts = state.get("finished_counts")
    if isinstance(counts, dict):
        out.finished_counts = {str(k): float(v) for k, v in counts.items() if isinstance(v, (int, float))}
    saved = state.get("saved_wall")
    out.saved_wall = float(saved) if isinstance(saved, (int, float)) else None
    out.problems += report.problems
    return out


#: ``core.clientid``'s separator; a client string of the releases before identity (450c1b4) had four parts
#: (peer address, host name, pid, instance), one of this release five (principal, identity, and the three).
_SEP = "\x1f"
_LEGACY_PARTS = 4


def legacy_client(client: str) -> str | None:
    """A client string of the releases before identity (issue 29) as this release would make it for the same
    pusher, or None when this release makes it from what the journal does not hold: a loopback (or unknown)
    address is now the kernel's view of the process (its uid, pid and start time), never the address. A
    remote address is the identity it still is (``ip=ADDRESS``). A client of this release is kept as it is."""
    parts = client.split(_SEP)
    if not client or len(parts) != _LEGACY_PARTS:
        return client
    address, host, pid, instance = parts
    ip = parse_ip(address)
    if ip is None or ip.is_loopback:
        return None
    return client_id(address, (("host_name", host), ("process_pid", pid), ("service_instance_id", instance)))


def legacy_owners(run: Run) -> None:
    """A migrated run's owners (``Run.owners``, ``Run.client``) as this release's clients. A rank whose
    owner this release cannot name (a loopback pusher: ``legacy_client``) is left unowned: the first push
    after the upgrade owns it again, as a new run's first push does, rather than every push of the process
    that owned it colliding with its own run (``ledger.clients``: a run id scoped to it, the run split in
    two rows)."""
    owners: dict[str, str] = {}
    for rank, client in run.owners.items():
        now = legacy_client(client) if isinstance(client, str) else None
        if now is not None:
            owners[rank] = now
    run.owners = owners
    starter = legacy_client(run.client) if isinstance(run.client, str) else None
    run.client = starter if starter is not None else ""


def _items(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else []


def _fields(item: _Standin) -> dict[str, Any]:
    """A stand-in's fields by name, whatever shape pickle gave its state."""
    state = item.state
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
        merged = dict(state[0] or {})
        merged.update(state[1] or {})
        return merged
    if isinstance(state, dict):
        return dict(state)
    if isinstance(state, list):
        layout = list(LAYOUTS.get(item.key[1], ()))
        cls = codec.resolve(KNOWN[item.key]) if KNOWN[item.key] else None
        if cls is not None and dataclasses.is_dataclass(cls):
            layout += [f.name for f in dataclasses.fields(cls) if f.name not in layout]
        if len(state) > len(layout):
            raise codec.DecodeError(f"{item.key[1]} has {len(state)} fields, more than its known layout")
        return dict(zip(layout, state, strict=False))
    if state is None:
        return {}
    raise codec.DecodeError(f"{item.key[1]}: unexpected state")


def _run_id(item: Any) -> str | None:
    """The run id a stand-in names, when it can be read."""
    if isinstance(item, _Standin):
        try:
            run_id = _fields(item).get("run_id")
        except codec.DecodeError:
            return None
        if isinstance(run_id, str):
            return run_id
    return None


def to_tree(value: Any) -> Any:
    """A stand-in tree as the codec's tagged data."""
    if isinstance(value, _Standin):
        name = KNOWN[value.key]
        if not name:
            raise codec.DecodeError(f"a {value.key[1]} where none belongs")
        return {"__c": name, "f": {k: to_tree(v) for k, v in _fields(value).items()}}
    t = type(value)
    if t in (str, int, float, bool, type(None)):
        return value
    if t is list:
        return [to_tree(v) for v in value]
    if t is tuple:
        return {"__t": [to_tree(v) for v in value]}
    if t is dict:
        return {"__d": [[to_tree(k), to_tree(v)] for k, v in value.items()]}
    if t is deque:
        return {"__q": [to_tree(v) for v in value], "n": value.maxlen}
    if t is set:
        return {"__s": [to_tree(v) for v in value]}
    if t is frozenset:
        return {"__fs": [to_tree(v) for v in value]}
    raise codec.DecodeError(f"unexpected {t.__name__} in the journal")


def _row(item: Any, report: codec.Decoded) -> dict[str, Any]:
    if not isinstance(item, _Standin) or item.key[1] != "Row":
        raise codec.DecodeError("not a row")
    f = _fields(item)
    summary = codec.decode(to_tree(f.get("summary")), report)
    doc = codec.decode(to_tree(f.get("doc")), report)
    if not isinstance(summary, dict) or not isinstance(doc, dict) or not isinstance(f.get("run_id"), str):
        raise codec.DecodeError("its summary is not a mapping")
    start = f.get("start")
    return {"seq": f.get("seq") if isinstance(f.get("seq"), int) else 0, "run_id": f["run_id"],
            "start": float(start) if isinstance(start, (int, float)) else 0.0, "summary": summary, "doc": doc,
            "json_name": f.get("json_name") if isinstance(f.get("json_name"), str) else None}
