"""The run ledger's state as JSON: a generic, explicit codec of the objects an open run is made of, for the
ledger's database (``ledger.store``). Never pickle: decoding builds only the ledger's own classes, field by
field, and never calls anything a record names.

``encode`` turns a value into JSON-able data: scalars as they are (NaN and infinities use Python's JSON
extension: the state is the exporter's own, not an interchange format), lists and string-keyed dicts as JSON,
and tagged objects for what JSON lacks: ``{"__t": [...]}`` a tuple, ``{"__s"}``/``{"__fs"}`` a set/frozenset,
``{"__q", "n"}`` a deque, ``{"__d": [[k, v], ...]}`` a dict with other keys, ``{"__c": "module:Class",
"f": {...}}`` an object. Lists and deques of tuples (a run's timeline, a series' recent points: most of the
bytes) are only copied under the ledger's lock (``Rows``: the tuples are immutable) and written by column on the
store's thread (``{"__cols": [...], "n"}``): a column of floats as little-endian IEEE 754 doubles in base64
(``{"__f8", "none"}``, the indexes of its Nones apart), any other column as a JSON array; decoding zips the
columns back into tuples, so 256 runs of 2,000 timeline points restore in a fraction of a second.

Objects are encoded from their fields, whatever they are: a dataclass by ``dataclasses.fields``, the ledger's
plain classes (``Run``, ``Timeline``) by their attributes. Decoding is forgiving in the way an upgrade needs:
a field the record lacks (a newer release added it) takes its default (a fresh instance's value, or the
field's default, or the zero of its type); a field the class no longer has is dropped; a field that does not
decode takes its default too, and is reported (``Decoded.problems``). So a run's record outlives the fields
of its classes changing; only a record that is not JSON, or not an object of a known class, is damaged.

Pure: no I/O, no locks, no clock.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
import logging
import sys
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from gpu_energy_exporter.ledger.accounting import Timeline
from gpu_energy_exporter.ledger.runs import Run

log = logging.getLogger(__name__)

_PACKAGE = "gpu_energy_exporter."
_SCALARS = frozenset((str, int, float, bool, type(None)))

#: Attributes never written: caches and what a restore recomputes (``ledger.restart``).
TRANSIENT: dict[type, frozenset[str]] = {
    Run: frozenset({"live_memo", "settled_memo", "checkpoints", "alive_checkpoint"}),
}


def _blank_run() -> Run:
    return Run("", 0.0, 0.0, True, 4, 0.0)


#: The ledger's plain (non-dataclass) classes a record may hold, and how to make a blank one whose
#: attributes are the defaults of the fields a record lacks.
PLAIN: dict[type, Callable[[], Any]] = {Run: _blank_run, Timeline: lambda: Timeline(4)}


class DecodeError(ValueError):
    """A record (or part of one) that is not the ledger's state."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


# ----------------------------------------------------------------------------------------------------
# encoding


def encode(value: Any, skip: frozenset[str] = frozenset()) -> Any:
    """``value`` as JSON-able data (see the module docstring). Raises TypeError for a value of no known kind
    (a lambda, a lock): callers skip that field (``encode_fields``). ``skip``: attributes of ``value`` (an
    object) left out, to be saved apart."""
    t = type(value)
    if t in _SCALARS:
        return value
    if t is list:
        if value and type(value[0]) is tuple:
            return Rows(list(value), None)
        return [encode(v) for v in value]
    if t is tuple:
        return {"__t": [encode(v) for v in value]}
    if t is dict:
        if all(type(k) is str and not k.startswith("__") for k in value):
            return {k: encode(v) for k, v in value.items()}
        return {"__d": [[encode(k), encode(v)] for k, v in value.items()]}
    if t is deque:
        if value and type(value[0]) is tuple:
            return Rows(list(value), value.maxlen, deque=True)
        return {"__q": [encode(v) for v in value], "n": value.maxlen}
    if t is set:
        return {"__s": [encode(v) for v in value]}
    if t is frozenset:
        return {"__fs": [encode(v) for v in value]}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"__c": _name(t), "f": encode_fields(value, (f.name for f in dataclasses.fields(value)
                                                              if f.name not in skip))}
    if t in PLAIN:
        skip = skip | TRANSIENT.get(t, frozenset())
        return {"__c": _name(t), "f": encode_fields(value, (k for k in vars(value) if k not in skip))}
    raise TypeError(f"the ledger's state codec cannot encode a {t.__module__}.{t.__qualname__}")


_unencodable_logged: set[str] = set()


def encode_fields(obj: Any, names: Iterable[str]) -> dict[str, Any]:
    """The named attributes of ``obj``, encoded; one that cannot be is left out (it decodes as its default)
    and logged once per class and attribute."""
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = encode(getattr(obj, name))
        except TypeError as exc:
            where = f"{_name(type(obj))}.{name}"
            if where not in _unencodable_logged:
                _unencodable_logged.add(where)
                log.warning("run ledger: %s is not saved with the run's state (%s); it restarts from its default "
                            "after a restart", where, exc)
    return out


class Rows:
    """A list (or deque) of tuples, copied under the lock, written by column by ``dumps``."""

    __slots__ = ("rows", "maxlen", "deque")

    def __init__(self, rows: list[tuple[Any, ...]], maxlen: int | None, deque: bool = False) -> None:
        self.rows = rows
        self.maxlen = maxlen
        self.deque = deque

    def columns(self) -> dict[str, Any]:
        rows = self.rows
        width = len(rows[0])
        out: dict[str, Any]
        if any(len(r) != width for r in rows):  # not a table: row by row
            out = {"__rows": [list(r) for r in rows]}
        else:
            out = {"__cols": [_column(col) for col in zip(*rows, strict=True)], "n": len(rows)}
        if self.deque:
            out["q"] = self.maxlen
        return out


_BIG_ENDIAN = sys.byteorder == "big"


def _column(col: tuple[Any, ...]) -> Any:
    """One column of a table: packed floats, plain scalars, tuples of scalars, or anything (tagged)."""
    kinds = set(map(type, col))
    if kinds <= {float, type(None)} and float in kinds:
        nones = [i for i, v in enumerate(col) if v is None]
        packed = array("d", [0.0 if v is None else v for v in col])
        if _BIG_ENDIAN:
            packed.byteswap()
        return {"__f8": base64.b64encode(packed.tobytes()).decode("ascii"), "none": nones}
    if kinds <= _SCALARS:
        return list(col)
    if kinds <= {tuple, type(None)} and set(map(type, (x for v in col if v is not None for x in v))) <= _SCALARS:
        return {"__tup": [v if v is None else list(v) for v in col]}  # a timeline's power per GPU
    return {"__any": [encode(v) for v in col]}


def _json_default(value: Any) -> Any:
    if type(value) is Rows:
        return value.columns()
    return encode(value)  # an object inside a row: tagged like any other


def dumps(data: Any) -> str:
    """JSON text of encoded ``data`` (on the store's thread: no lock needed, the encoded data is not shared
    with the live state but for immutable tuples and scalars)."""
    return json.dumps(data, separators=(",", ":"), default=_json_default)


# ----------------------------------------------------------------------------------------------------
# decoding


class Decoded:
    """What one record's decoding found to report: fields that took their default."""

    def __init__(self) -> None:
        self.problems: list[str] = []


def loads(text: str | bytes, report: Decoded | None = None) -> Any:
    """The value a ``dumps`` text holds. DecodeError when it is not JSON or not state this codec wrote."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise DecodeError(f"not JSON ({exc})") from None
    return decode(data, report if report is not None else Decoded())


def decode(data: Any, report: Decoded) -> Any:
    t = type(data)
    if t in _SCALARS:
        return data
    if t is list:
        return [decode(v, report) for v in data]
    if t is Rows:  # what ``encode`` made, decoded without JSON between
        rows = [_row(r, report) for r in data.rows]
        return deque(rows, maxlen=data.maxlen) if data.deque else rows
    if t is not dict:
        raise DecodeError(f"unexpected {t.__name__}")
    if "__c" in data:
        return _object(data, report)
    if "__cols" in data:
        rows = _columns(data, report)
        return deque(rows, maxlen=_maxlen(data, "q")) if "q" in data else rows
    if "__rows" in data:
        rows = [_row(r, report) for r in _list(data["__rows"])]
        return deque(rows, maxlen=_maxlen(data, "q")) if "q" in data else rows
    if "__t" in data:
        return tuple(decode(v, report) for v in _list(data["__t"]))
    if "__d" in data:
        out = {}
        for pair in _list(data["__d"]):
            if type(pair) is not list or len(pair) != 2:
                raise DecodeError("a dict entry is not a pair")
            key = decode(pair[0], report)
            try:
                hash(key)
            except TypeError:
                raise DecodeError("a dict key is not hashable") from None
            out[key] = decode(pair[1], report)
        return out
    if "__q" in data:
        return deque((decode(v, report) for v in _list(data["__q"])), maxlen=_maxlen(data))
    if "__s" in data:
        return set(_hashable(decode(v, report)) for v in _list(data["__s"]))
    if "__fs" in data:
        return frozenset(_hashable(decode(v, report)) for v in _list(data["__fs"]))
    return {k: decode(v, report) for k, v in data.items()}


def _list(value: Any) -> list[Any]:
    if type(value) is not list:
        raise DecodeError("a tagged value is not a list")
    return value


def _maxlen(data: dict[str, Any], key: str = "n") -> int | None:
    n = data.get(key)
    if n is not None and (type(n) is not int or n < 0):
        raise DecodeError("a deque's maxlen is not a count")
    return n


def _hashable(value: Any) -> Any:
    try:
        hash(value)
    except TypeError:
        raise DecodeError("a set member is not hashable") from None
    return value


def _columns(data: dict[str, Any], report: Decoded) -> list[tuple[Any, ...]]:
    """The rows a ``__cols`` table holds."""
    n = data.get("n")
    if type(n) is not int:
        raise DecodeError("a table without its length")
    cols = []
    for col in _list(data["__cols"]):
        if type(col) is list:  # scalars, as checked when written
            values = col
        elif type(col) is dict and "__f8" in col:
            values = _floats(col)
        elif type(col) is dict and "__tup" in col:
            values = [v if v is None else tuple(v) for v in _list(col["__tup"])]
        elif type(col) is dict and "__any" in col:
            values = [decode(v, report) for v in _list(col["__any"])]
        else:
            raise DecodeError("a table's column is not a list")
        if len(values) != n:
            raise DecodeError("a table's columns differ in length")
        cols.append(values)
    if not cols:
        return [() for _ in range(n)]
    return list(zip(*cols, strict=True))


def _floats(col: dict[str, Any]) -> list[Any]:
    try:
        packed = array("d")
        packed.frombytes(base64.b64decode(col["__f8"], validate=True))
    except (KeyError, TypeError, ValueError, binascii.Error):
        raise DecodeError("a packed column does not decode") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    values: list[Any] = packed.tolist()
    for i in _list(col.get("none", [])):
        if type(i) is not int or not 0 <= i < len(values):
            raise DecodeError("a packed column's None is out of range")
        values[i] = None
    return values


def _row(value: Any, report: Decoded) -> Any:
    """A row of a ``__rows`` list: arrays were tuples, objects are tagged."""
    t = type(value)
    if t is list or t is tuple:  # an array in JSON; a tuple when decoding what ``encode`` made directly
        return tuple([_row(v, report) for v in value])
    if t is dict:
        return decode(value, report)
    if t in _SCALARS:
        return value
    raise DecodeError(f"unexpected {t.__name__} in a row")


def known_classes() -> dict[str, type]:
    """The classes a record may name: the ledger's plain classes and every dataclass of this package that is
    loaded (never importing anything: a record cannot make the exporter load a module)."""
    out: dict[str, type] = {_name(c): c for c in PLAIN}
    for modname, module in list(sys.modules.items()):
        if not modname.startswith(_PACKAGE) or module is None:
            continue
        for value in list(vars(module).values()):
            if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == modname:
                out[_name(value)] = value
    return out


_classes: dict[str, type] = {}


def resolve(name: Any) -> type:
    """The class a record names (``module:qualname``; a class moved since is found by its unique name)."""
    if type(name) is not str:
        raise DecodeError("an object's class is not a name")
    cls = _classes.get(name)
    if cls is None:
        _classes.update(known_classes())
        cls = _classes.get(name)
    if cls is None:  # moved to another module since: the same class name, if it is unique
        qual = name.rpartition(":")[2]
        same = [c for n, c in _classes.items() if n.rpartition(":")[2] == qual]
        if len(same) != 1:
            raise DecodeError(f"unknown class {name!r}")
        cls = same[0]
    return cls


def _object(data: dict[str, Any], report: Decoded) -> Any:
    cls = resolve(data["__c"])
    stored = data.get("f")
    if type(stored) is not dict:
        raise DecodeError(f"{cls.__qualname__}: its fields are not an object")
    if cls in PLAIN:
        obj = PLAIN[cls]()
        defaults = vars(obj)
        for key, raw in stored.items():
            if key not in defaults:
                continue  # an attribute this release does not have: dropped
            try:
                setattr(obj, key, decode(raw, report))
            except DecodeError as exc:
                report.problems.append(f"{cls.__qualname__}.{key} ({exc})")
        return obj
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.name in stored:
            try:
                kwargs[f.name] = decode(stored[f.name], report)
                continue
            except DecodeError as exc:
                report.problems.append(f"{cls.__qualname__}.{f.name} ({exc})")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kwargs[f.name] = zero_of(f.type)
    try:
        return cls(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a field of another type than the class expects
        raise DecodeError(f"{cls.__qualname__} ({exc})") from None


def zero_of(annotation: Any) -> Any:
    """The zero of a field's type (its annotation, a string under ``from __future__ import annotations``)
    for a required field a record lacks."""
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    text = text.replace(" ", "")
    if "None" in text.split("|"):
        return None
    zeros: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("float", float), ("int", int), ("str", str), ("bool", bool), ("dict", dict), ("list", list),
        ("set", set), ("frozenset", frozenset), ("tuple", tuple), ("deque", deque))
    for prefix, zero in zeros:
        if text.startswith(prefix):
            return zero()
    return None
