"""Admission for the OTLP/gRPC receiver's calls: ``SLOTS`` calls receive or are handled at once, waiting calls
cut the slowest receiver (``EVICT_AFTER``), and the codes a call is refused with.

Pure asyncio on the receiver's loop thread (no lock: nothing awaits between a check and what it decides).
This module never imports grpc and never reads a message itself: ``Call.read`` is the receiver's pending read,
which ``Call.stop`` cancels.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gpu_energy_exporter.core.lazymodule import lazy

if TYPE_CHECKING:
    import asyncio
else:
    asyncio = lazy("asyncio")  # the receiver's first connection loads it (grpcreceiver.py)

#: Calls receiving or being handled at once (each may hold one message of --otlp.max-body-bytes).
SLOTS = 4
#: A call still receiving its message after this long is cut when another call waits for its slot.
EVICT_AFTER = 1.0


class Refused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Call:
    """One call: when it started receiving (holding a slot), its pending read, and why that read was cut."""

    __slots__ = ("receiving_since", "read", "cut")

    def __init__(self) -> None:
        self.receiving_since: float | None = None
        self.read: asyncio.Future[Any] | None = None
        self.cut = ""  # the code the read was cut with (UNAVAILABLE, DEADLINE_EXCEEDED)

    def stop(self, code: str) -> None:
        if self.read is not None and not self.read.done() and not self.cut:
            self.cut = code
            self.read.cancel()


class Slots:
    """``SLOTS`` calls at once; waiting calls cut the slowest receiver (loop thread only, no lock: nothing
    awaits between a check and what it decides)."""

    def __init__(self, n: int, clock: Callable[[], float]) -> None:
        self._n = n
        self._clock = clock
        self._holders: list[Call] = []
        self._waiting = 0
        self._changed = asyncio.Condition()

    def _evict_slowest(self) -> None:
        receiving = [c for c in self._holders if c.receiving_since is not None and not c.cut]
        if receiving:
            oldest = min(receiving, key=lambda c: c.receiving_since or 0.0)
            if self._clock() - (oldest.receiving_since or 0.0) > EVICT_AFTER:
                oldest.stop("UNAVAILABLE")

    async def acquire(self, call: Call, deadline: float) -> None:
        if len(self._holders) < self._n and not self._waiting:
            self._holders.append(call)  # the common case: a free slot, no one ahead
            return
        self._waiting += 1
        try:
            async with self._changed:
                while len(self._holders) >= self._n:
                    self._evict_slowest()
                    remaining = deadline - self._clock()
                    if remaining <= 0:
                        raise Refused("DEADLINE_EXCEEDED", "the receiver was busy for the whole of "
                                       "--web.request-timeout; try again")
                    try:
                        # woken by a release, or soon enough to cut a receiver that became slow meanwhile
                        await asyncio.wait_for(self._changed.wait(), min(remaining, EVICT_AFTER))
                    except asyncio.TimeoutError:
                        pass
                self._holders.append(call)
        finally:
            self._waiting -= 1

    async def release(self, call: Call) -> None:
        self._holders.remove(call)
        if self._waiting:
            async with self._changed:
                self._changed.notify()
