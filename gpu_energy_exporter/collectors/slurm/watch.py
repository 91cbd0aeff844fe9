"""A small watch of the Slurm job-mapping directory: a job's prolog or epilog makes the exporter read its
energy counters at once.

A job's edges are the mapping files' own modification times (``slurm.edges``); for the job's settled energy
to cover exactly its interval, the energy counters must be read right then, not at the next sample (up to a
second later) nor the next scheduled counter read (up to ``--collector.energy-interval``). ``DirectoryWatch``
calls ``on_change`` (the exporter's ``read_counters_now``: every counter read in a sample taken at once) when
the directory changes: through inotify (``inotify_init1`` / ``inotify_add_watch`` through ctypes, the events
read on a thread of its own), for the GPU files only (a prolog's temp files and ``.info`` are not edges);
where inotify is not available (no libc symbol, no permission, the limit of watches reached, a file system
that does not report changes) by polling ``os.stat`` of the directory every ``poll_s`` (0.1 s): its mtime
moves when a file is created, renamed or removed, which is how the prolog and epilog write. A directory
that does not exist yet (no job has run) is polled for until it appears, and watched again if it is removed
and created again.

Only wakes the exporter: never reads the mapping (the slurm collector does, on the sampler thread), never
decides anything about jobs. ``on_change`` must be cheap and thread-safe.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
import struct
import threading
from collections.abc import Callable

from gpu_energy_exporter.collectors.slurm.mapping import GPU_FILE

log = logging.getLogger(__name__)

# linux/inotify.h
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_UNMOUNT, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x2000, 0x4000, 0x8000
IN_ONLYDIR = 0x01000000
#: what a GPU file's write by the prolog (temp file + rename), the epilog (rename or unlink) or an in-place
#: writer (close after write; ``touch``) looks like from the directory
WATCH_MASK = (IN_CLOSE_WRITE | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
              | IN_DELETE_SELF | IN_MOVE_SELF | IN_ONLYDIR)
#: the watch itself is gone (the directory removed or moved, its file system unmounted): watch again
GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_UNMOUNT | IN_IGNORED
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)

POLL_S = 0.1


def dir_mtime(path: str) -> float | None:
    """The directory's modification time (wall seconds), None when it cannot be read."""
    try:
        return os.stat(path).st_mtime_ns / 1e9
    except OSError:
        return None


def _stat_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


class _Inotify:
    """inotify through libc (ctypes): one descriptor, one watch at a time."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._init1 = libc.inotify_init1
        self._init1.argtypes, self._init1.restype = [ctypes.c_int], ctypes.c_int
        self._add = libc.inotify_add_watch
        self._add.argtypes, self._add.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32], ctypes.c_int
        fd = self._init1(os.O_NONBLOCK | os.O_CLOEXEC)  # IN_NONBLOCK, IN_CLOEXEC are these flags
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
        self.fd = fd

    def add_watch(self, path: str) -> int:
        wd = self._add(self.fd, os.fsencode(path), WATCH_MASK)
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e), path)
        return wd

    def read(self) -> list[tuple[int, int, str]]:
        """The pending events: (wd, mask, name)."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        out = []
        i = 0
        while i + _EVENT.size <= len(data):
            wd, mask, _, n = _EVENT.unpack_from(data, i)
            name = data[i + _EVENT.size:i + _EVENT.size + n].split(b"\0", 1)[0]
            out.append((wd, mask, os.fsdecode(name)))
            i += _EVENT.size + n
        return out

    def close(self) -> None:
        os.close(self.fd)


class DirectoryWatch:
    """Calls ``on_change`` when the job-mapping directory ``path`` changes (module docstring). ``inotify``:
    False forces polling. ``start`` / ``stop``; ``mode`` says which is in use ("inotify", "poll")."""

    def __init__(self, path: str, on_change: Callable[[], None], *, poll_s: float = POLL_S,
                 inotify: bool = True) -> None:
        self.path = path
        self._on_change = on_change
        self._poll_s = poll_s
        self._want_inotify = inotify
        self._stop = threading.Event()
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._inotify: _Inotify | None = None
        self.mode = "poll"
        self.changes = 0  # times on_change was called (tests, debugging)

    def start(self) -> None:
        if self._thread is not None:
            return
        if self._want_inotify:
            try:
                self._inotify = _Inotify()
                self.mode = "inotify"
            except (OSError, AttributeError) as exc:  # no such symbol, EMFILE, ENOSYS
                log.info("Slurm job-mapping directory %s: inotify not available (%s); polling it every %gs",
                         self.path, exc, self._poll_s)
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="slurm-mapping-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        if self._inotify is not None:
            self._inotify.close()
            self._inotify = None

    def _changed(self) -> None:
        self.changes += 1
        try:
            self._on_change()
        except Exception:  # noqa: BLE001 - the watch must outlive a failing listener
            log.debug("job-mapping change listener failed", exc_info=True)

    def _run(self) -> None:
        key = _stat_key(self.path)
        while not self._stop.is_set():
            if self._inotify is not None and key is not None:
                try:
                    wd = self._inotify.add_watch(self.path)
                except OSError as exc:
                    if exc.errno not in (errno.ENOENT, errno.ENOTDIR):
                        log.info("Slurm job-mapping directory %s: cannot watch it (%s); polling it every %gs",
                                 self.path, exc, self._poll_s)
                        self._inotify.close()
                        self._inotify, self.mode = None, "poll"
                else:
                    if _stat_key(self.path) != key:
                        self._changed()  # changed while the watch was being set up
                    self._follow(wd)
                    if self._stop.is_set():
                        return
                    self._changed()  # the directory went away (or moved): that is a change too
                    key = _stat_key(self.path)
                    continue
            # Polling: the directory's mtime (and inode: removed and created again) every poll_s; also how a
            # directory that does not exist yet is waited for, inotify or not.
            if self._sleep(self._poll_s):
                return
            now = _stat_key(self.path)
            if now != key:
                key = now
                self._changed()

    def _follow(self, wd: int) -> None:
        """Read inotify events until the watch is gone or the watch is stopped."""
        assert self._inotify is not None
        poller = select.poll()
        poller.register(self._inotify.fd, select.POLLIN)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stop.is_set():
            ready = {fd for fd, _ in poller.poll()}
            if self._wake_r in ready:
                return
            changed = gone = False
            for event_wd, mask, name in self._inotify.read():
                if event_wd != wd and not mask & IN_Q_OVERFLOW:
                    continue
                if mask & GONE:
                    gone = True
                elif mask & IN_Q_OVERFLOW or GPU_FILE.match(name):
                    changed = True
            if changed:
                self._changed()
            if gone:
                return

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stopped; True when stopped."""
        if self._wake_r < 0:
            return self._stop.wait(seconds)
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        return bool(poller.poll(seconds * 1000.0)) or self._stop.is_set()
