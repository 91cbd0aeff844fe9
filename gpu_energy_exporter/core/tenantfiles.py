"""Reading files that someone else can write: the Slurm job-mapping directory, ``/proc/<pid>/...`` of a
tenant's process. What such a file is, and how long reading it takes, is the writer's choice.

- ``read_regular(path, max_bytes)`` opens without following a final symlink and without blocking
  (``O_NONBLOCK``: a FIFO or a device opens at once instead of waiting for a writer), checks with ``fstat``
  that what it opened is a regular file (``NotRegular`` otherwise, naming its type), and reads at most
  ``max_bytes`` (``TooLarge`` beyond). procfs files are regular files.
- ``Watchdog(name, timeout_s).call(fn, *args)`` runs ``fn`` on a thread of its own and waits at most
  ``timeout_s``: a read stuck in the kernel (a hung NFS or FUSE mount, a process holding its memory lock)
  raises ``Stuck`` to the caller, which goes on; until the stuck call returns, further calls raise ``Stuck``
  at once, so one ``Watchdog`` never leaves more than one thread behind.

Never decides what a file means; imports nothing of the package.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["NotRegular", "Stuck", "TooLarge", "Watchdog", "read_regular"]

T = TypeVar("T")

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class NotRegular(OSError):
    """The path is not a regular file (a FIFO, a device, a directory, a socket)."""


class TooLarge(ValueError):
    """The file holds more than the reader's bound."""


class Stuck(TimeoutError):
    """A read did not return within the watchdog's timeout (or an earlier one still has not)."""


def read_regular(path: str | os.PathLike[str], max_bytes: int) -> bytes:
    """The bytes of the regular file at ``path`` (``max_bytes`` at most); ``NotRegular``, ``TooLarge`` or the
    ``OSError`` of opening or reading it. A symlink as the last component is refused (``ELOOP``)."""
    fd = os.open(path, _FLAGS)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise NotRegular(0, f"{kind}, not a regular file", os.fspath(path))
        chunks: list[bytes] = []
        size = 0
        while size <= max_bytes:
            try:
                chunk = os.read(fd, max_bytes + 1 - size)
            except BlockingIOError:  # a regular file never says so; a file system that does is not waited for
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:
            raise TooLarge(f"larger than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class Watchdog:
    """Calls run on one worker thread (a daemon, started on the first call), each waited for ``timeout_s`` at
    most; see the module docstring."""

    def __init__(self, name: str, timeout_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.name = name
        self.timeout_s = timeout_s
        self._queue: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stuck: _Call | None = None
        self._lock = threading.Lock()
        self.stuck_total = 0  # calls that overran

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker thread: its result or exception, or ``Stuck``."""
        with self._lock:
            if self._stuck is not None:
                if not self._stuck.done.is_set():
                    raise Stuck(f"{self.name}: an earlier read has not returned yet")
                self._stuck = None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            c = _Call(fn, args)
            self._queue.put(c)
            if not c.done.wait(self.timeout_s):
                self._stuck = c
                self.stuck_total += 1
                raise Stuck(f"{self.name}: a read took more than {self.timeout_s:g}s")
        if c.error is not None:
            raise c.error
        result: T = c.result
        return result

    def _run(self) -> None:
        while True:
            c = self._queue.get()
            try:
                c.result = c.fn(*c.args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
                c.error = exc
            c.done.set()
