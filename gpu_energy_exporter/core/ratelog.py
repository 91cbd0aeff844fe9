"""Log lines that a flood can repeat, rate-limited, with a count of what was left out.

``RateLimitedLog(logger).warning(key, msg, *args)`` writes at most ``burst`` lines per ``key`` in each
``period_s``; the lines of that key past the burst are counted, not written, and the key's next written line
ends with how many were left out since the last one ("... (412 more like this in the last 60s)"). ``flush()``
writes that count for every key whose period is over, for callers with a loop of their own (so a flood that
stopped is still reported). Keys are what makes two lines "the same" (a GPU and an Xid code, a refusal
reason): a flood of one never hides another. At most ``max_keys`` keys are remembered (the one written
longest ago is forgotten first), so a flood of distinct keys costs bounded memory; each forgotten key's
left-out count is written with it, once.

Why: an Xid on every driver wait wrote 2.2 million lines (315 MB) in 40 s and took a core; every refused
point, journal error or stuck file can be repeated as fast as a neighbour can make it happen.

Thread-safe (one lock around plain counters, never held while logging); never raises, never blocks on
anything but that lock, and imports nothing of the package.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

__all__ = ["RateLimitedLog"]


class _Key:
    __slots__ = ("since", "written", "left_out", "last")

    def __init__(self, since: float) -> None:
        self.since = since  # start of the current period
        self.written = 0  # lines written in it
        self.left_out = 0  # lines counted, not written, since the last written one
        self.last = ""  # the last line written (its start), named by the count of those left out after it


class RateLimitedLog:
    """At most ``burst`` lines per key per ``period_s`` on ``logger``; see the module docstring."""

    def __init__(self, logger: logging.Logger, *, period_s: float = 60.0, burst: int = 1, max_keys: int = 256,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if period_s <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("period_s must be positive, burst and max_keys at least 1")
        self.logger = logger
        self.period_s = period_s
        self.burst = burst
        self.max_keys = max_keys
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[Hashable, _Key] = OrderedDict()
        self.left_out_total = 0  # every line counted and not written, for self-metrics and tests

    def log(self, level: int, key: Hashable, msg: str, *args: object) -> bool:
        """Write ``msg % args`` at ``level`` unless ``key`` used its burst in this period; True when written."""
        if not self.logger.isEnabledFor(level):
            return False
        now = self._clock()
        forgotten: list[tuple[str, int]] = []
        with self._lock:
            state = self._keys.get(key)
            if state is None:
                state = self._keys[key] = _Key(now)
                while len(self._keys) > self.max_keys:
                    old_key, old = self._keys.popitem(last=False)
                    if old.left_out:
                        forgotten.append((old.last, old.left_out))
            elif now - state.since >= self.period_s:
                state.since, state.written = now, 0
            if state.written >= self.burst:
                state.left_out += 1
                self.left_out_total += 1
                left_out = -1
            else:
                state.written += 1
                left_out, state.left_out = state.left_out, 0
                self._keys.move_to_end(key)
        for last, n in forgotten:
            self._summary(level, last, n)
        if left_out < 0:
            return False
        try:
            text = msg % args if args else msg
        except (TypeError, ValueError):  # as logging would: the template and its arguments, unformatted
            text = f"{msg} {args!r}"
        state.last = text[:200]
        if left_out:
            text += f" ({left_out} more like this in the last {self.period_s:g}s, not logged)"
        self.logger.log(level, "%s", text)
        return True

    def warning(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)

    def error(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.ERROR, key, msg, *args)

    def info(self, key: Hashable, msg: str, *args: object) -> bool:
        return self.log(logging.INFO, key, msg, *args)

    def flush(self, level: int = logging.WARNING) -> None:
        """Write the left-out count of every key whose period is over (and start its next period)."""
        now = self._clock()
        due: list[tuple[str, int]] = []
        with self._lock:
            for state in self._keys.values():
                if state.left_out and now - state.since >= self.period_s:
                    due.append((state.last, state.left_out))
                    state.left_out, state.since, state.written = 0, now, 1
        for last, n in due:
            self._summary(level, last, n)

    def _summary(self, level: int, last: str, n: int) -> None:
        self.logger.log(level, "%d more line(s) like %r in the last %gs, not logged (rate-limited)", n, last,
                        self.period_s)
