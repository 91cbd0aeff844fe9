"""Bounded memos for what clients repeat (label names, header lines, encoded heads, Accept headers).

Each memo is a plain dict read with ``.get`` on the hot path; ``remember`` stores a miss. A memo at its limit
is emptied rather than trimmed: the entries a client repeats come back on their next use, and values that
churn (run ids, hostile headers) cannot grow it without bound or cost an eviction policy per hit.
"""

from __future__ import annotations

from typing import TypeVar

_K = TypeVar("_K")
_V = TypeVar("_V")


def remember(memo: dict[_K, _V], key: _K, value: _V, limit: int) -> _V:
    """Store ``value`` under ``key`` (``memo`` emptied first when it holds ``limit`` entries); returns ``value``."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value


__all__ = ["remember"]
