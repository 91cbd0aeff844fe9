"""The one rule that splits a GPU's energy between whoever uses it: pure arithmetic on plain values.

Runs (``ledger/split.py``), pods (``kubernetes/attribution.py``) and later Slurm jobs each map what they
know onto ``Member`` values and call ``split``; none of them writes a split rule of its own. A member is one
user of one piece of the GPU: a process NVML lists on it, a container holding a replica of it, a run
claiming it. Members are grouped by ``owner`` (whoever is charged: a run id, a container, a pid with no run)
and by ``unit`` (the whole GPU, ``""``, or one MIG instance).

The rules, in order (the returned rule names say which one applied to each part):

- ``mig``: the GPU is partitioned. NVML gives no power per instance, so the GPU's energy is split over the
  instances in use in proportion to their compute slices (``slices``); instances no member uses get
  nothing (those in use absorb the whole GPU); inside one instance the members share evenly.
- ``exclusive``: one owner uses the (whole) GPU: it gets all of it, idle power included.
- ``sm_util``: several owners share the whole GPU and every member has a measured weight (NVML's per-process
  SM utilisation) and the weights sum above zero: split in proportion to the weights. A weight that is not
  a finite number >= 0 (NaN, negative, infinite) is no measurement: the rule falls to ``even``. A member that pushes
  nothing anywhere keeps its share: the splitter never looks at who pushed what.
- ``even``: several owners share the whole GPU without usable weights: split evenly per member.

The parts sum to ``total`` whenever ``members`` is not empty (no member: nothing is split; the caller counts
the energy as unattributed). This module never does I/O, never reads a clock and imports nothing of the
package.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

RULE_EXCLUSIVE = "exclusive"
RULE_SM_UTIL = "sm_util"
RULE_EVEN = "even"
RULE_MIG = "mig"
RULES = (RULE_EXCLUSIVE, RULE_SM_UTIL, RULE_EVEN, RULE_MIG)

O = TypeVar("O", bound=Hashable)  # noqa: E741 - the owner type (a run id, a container, a pid)

__all__ = ["RULES", "RULE_EVEN", "RULE_EXCLUSIVE", "RULE_MIG", "RULE_SM_UTIL", "Member", "split"]


@dataclass(frozen=True, slots=True)
class Member(Generic[O]):
    """One user of one piece of a GPU. ``weight``: measured use (SM utilisation, any scale), None when
    unknown; ``slices``: the MIG compute slices of ``unit`` (1 for the whole GPU)."""

    owner: O
    unit: str = ""
    slices: int = 1
    weight: float | None = None


def split(total: float, members: Sequence[Member[O]]) -> list[tuple[O, str, float]]:
    """``total`` split over ``members``: (owner, rule, part) per owner and unit, in a stable order (owners
    as first met). The parts sum to ``total`` when ``members`` is not empty."""
    if not members:
        return []
    units: dict[str, list[Member[O]]] = defaultdict(list)
    for m in members:
        units[m.unit].append(m)
    is_mig = any(u for u in units)
    unit_weight = {u: (max(max(1, m.slices) for m in ms) if u else 1) for u, ms in units.items()}
    total_weight = sum(unit_weight.values())
    out: list[tuple[O, str, float]] = []
    for unit in sorted(units):
        unit_members = units[unit]
        energy = total * unit_weight[unit] / total_weight
        count: dict[O, int] = {}
        weight: dict[O, float] = {}
        measured = True
        for m in unit_members:
            count[m.owner] = count.get(m.owner, 0) + 1
            if m.weight is None or not 0 <= m.weight < math.inf:  # None, NaN, negative, infinite: not usable
                measured = False
            else:
                weight[m.owner] = weight.get(m.owner, 0.0) + m.weight
        n = len(unit_members)
        if is_mig:
            out.extend((owner, RULE_MIG, energy * k / n) for owner, k in count.items())
        elif len(count) == 1:
            out.append((unit_members[0].owner, RULE_EXCLUSIVE, energy))
        elif measured and sum(weight.values()) > 0:
            wsum = sum(weight.values())
            out.extend((owner, RULE_SM_UTIL, energy * weight.get(owner, 0.0) / wsum) for owner in count)
        else:
            out.extend((owner, RULE_EVEN, energy * k / n) for owner, k in count.items())
    return out
