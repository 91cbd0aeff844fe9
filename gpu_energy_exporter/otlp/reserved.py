"""The training contract's names are reserved: under the helper's instrument names (``core.contract``) only
the contract's own type and labels are accepted.

A point whose Prometheus name is, or would expose, a name of the contract (``training_tokens`` as a gauge,
``training_tokens_total`` as a gauge, ``training_run_finished`` as a counter, which exposes
``training_run_finished_total`` and claims ``training_run_finished``...) takes the family from the real
instrument for the store's series TTL: every later run's tokens or finish would be refused. Such a point is
rejected alone (reason ``contract_violation``), before the store sees it, so the real points keep their
family. A point of the right type must carry a ``run_id`` and only the contract's attributes
(``contract.POINT_ATTRIBUTES``; ``training.run.info`` its metadata and counting attributes too).

Pure: names and labels in, a refusal or ``None`` out. Never touches the store, never reads a request.
"""

from __future__ import annotations

from gpu_energy_exporter.core import contract
from gpu_energy_exporter.otlp.points import Kind, Labels
from gpu_energy_exporter.otlp.series import claimed_names

REASON = "contract_violation"

#: Prometheus family name -> the store kind the contract gives it.
_KINDS: dict[str, Kind] = {i.prometheus: i.kind for i in contract.ALL}
#: Every exposed name a contract family uses -> the contract family.
_CLAIMS: dict[str, str] = {claimed: i.prometheus for i in contract.ALL
                           for claimed in claimed_names(i.prometheus, i.kind)}

_POINT = frozenset(contract.POINT_ATTRIBUTES)
_INFO = _POINT | frozenset(contract.RUN_INFO_ATTRIBUTES) | frozenset(contract.COUNTING_ATTRIBUTES)
#: Labels each contract family accepts.
ALLOWED_LABELS: dict[str, frozenset[str]] = {
    i.prometheus: _INFO if i is contract.RUN_INFO else _POINT for i in contract.ALL
}


def family_refusal(name: str, kind: Kind, otel_name: str) -> tuple[str, str] | None:
    """A refusal when the family ``name`` of ``kind`` would take or shadow a contract name with another
    type or name; None when it is no contract family, or the contract's own."""
    owner = _CLAIMS.get(name)
    if owner is None:
        for claimed in claimed_names(name, kind) if kind in ("counter", "histogram", "summary") else ():
            owner = _CLAIMS.get(claimed)
            if owner is not None:
                break
    if owner is None:
        return None
    if owner == name and _KINDS[owner] == kind:
        return None
    return (REASON, f"{otel_name!r} as a {kind} ({name}) would take the training contract's {owner!r}, a "
            f"{_KINDS[owner]} (core/contract.py; docs/training.md): rename the metric")


def label_refusal(name: str, labels: Labels) -> str | None:
    """Why a point of the contract family ``name`` (``family_refusal`` accepted it) is refused: no
    ``run_id``, or a label the contract does not give the instrument; None when it is fine."""
    allowed = ALLOWED_LABELS[name]
    run_id = False
    for key, _ in labels:
        if key not in allowed:
            return (f"{name}: label {key[:100]!r} is not an attribute of the training contract "
                    f"({', '.join(sorted(allowed))})")
        if key == contract.ATTR_RUN_ID:
            run_id = True
    if not run_id:
        return f"{name}: a point of the training contract needs a run_id"
    return None


#: The label sets the contract families accept, one bit each (``family_bit``, ``labels_fit``): the translation
#: checks a point's labels once per label set (``translate``'s attribute cache), not once per point.
_LABEL_SETS: tuple[frozenset[str], ...] = tuple(dict.fromkeys(ALLOWED_LABELS.values()))
_BITS: dict[str, int] = {name: 1 << _LABEL_SETS.index(allowed) for name, allowed in ALLOWED_LABELS.items()}


def family_bit(name: str) -> int:
    """The bit of the label set the contract family ``name`` accepts; 0 when it is no contract family."""
    return _BITS.get(name, 0)


def labels_fit(labels: Labels) -> int:
    """The bits (``family_bit``) of the contract families whose ``label_refusal`` accepts ``labels``:
    ``label_refusal(name, labels)`` is None exactly when ``labels_fit(labels) & family_bit(name)``."""
    keys = {key for key, _ in labels}
    if contract.ATTR_RUN_ID not in keys:
        return 0
    return sum(1 << i for i, allowed in enumerate(_LABEL_SETS) if keys <= allowed)
