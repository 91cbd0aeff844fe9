"""Whether the run ledger may read state from a directory or file: only what the exporter's user wrote.

The rule is ssh's for its keys (``StrictModes``): the state directory, the database and every file read
from it must be owned by the exporter's (effective) user and writable by nobody else; otherwise another user
could have planted the state. ``directory_problem`` and ``file_problem`` say what is wrong and how to fix it,
in one line; the ledger then refuses the state and keeps its runs in memory (``ledger.recovery``).

The directories above are only warned about (``ancestor_warning``): one writable by other users (and not
sticky, like ``/tmp``) or owned by another user than root or the exporter's lets them move or delete the
state, but not plant any (they cannot make a directory or file the exporter's user owns), and a Kubernetes
``emptyDir`` mount point is world-writable inside its own pod.

Reads metadata only (``lstat``); never opens, creates or changes a file.
"""

from __future__ import annotations

import os
import pwd
import stat

_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _fix(path: str, is_dir: bool) -> str:
    user = _user(os.geteuid()).split(" ")[0]
    mode = "700" if is_dir else "600"
    return f"fix it with `chown {user} {path} && chmod {mode} {path}` (after checking what is in it)"


def _check(path: str, st: os.stat_result, *, is_dir: bool) -> str | None:
    euid = os.geteuid()
    what = "directory" if is_dir else "file"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link, not a {what} of the exporter's own; point the flag at the real path"
    if is_dir and not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not is_dir and not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file"
    if st.st_uid != euid:
        return (f"{path} is owned by {_user(st.st_uid)}, not by the exporter's user {_user(euid)}: "
                f"{_fix(path, is_dir)}")
    if st.st_mode & _OTHERS_WRITE:
        return (f"{path} is writable by its group or by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                f"{_fix(path, is_dir)}")
    if not is_dir and st.st_nlink > 1:
        return f"{path} has {st.st_nlink} hard links (another name could change it): copy it to a file of its own"
    return None


def _ancestors(path: str) -> list[str]:
    out = []
    parent = os.path.dirname(path)
    while parent and parent != path:
        out.append(parent)
        path, parent = parent, os.path.dirname(parent)
    return out


def _check_ancestor(path: str) -> str | None:
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot check {path} ({exc.strerror or exc})"
    if st.st_uid not in (0, os.geteuid()):
        return (f"{path}, above the state, is owned by {_user(st.st_uid)} (not root, not the exporter's user): "
                "that user can move or delete the state; keep it under a directory of root's or the exporter's")
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        return (f"{path}, above the state, is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}) and "
                "not sticky: they can move or delete the state; `chmod go-w` it or keep the state elsewhere")
    return None


def directory_problem(path: str) -> str | None:
    """None when the ledger may keep and read its state in the directory ``path`` (which exists), else what
    is wrong and what to do."""
    path = os.path.abspath(path)
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot check {path} ({exc.strerror or exc})"
    return _check(path, st, is_dir=True)


def ancestor_warning(path: str) -> str | None:
    """What is wrong with the directories above the state directory ``path`` (see the module docstring), or
    None."""
    path = os.path.abspath(path)
    for above in dict.fromkeys([*_ancestors(path), *_ancestors(os.path.realpath(path))]):
        found = _check_ancestor(above)
        if found:
            return found
    return None


def file_problem(path: str) -> str | None:
    """None when the file ``path`` is the exporter's own (or does not exist), else what is wrong."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot check {path} ({exc.strerror or exc})"
    return _check(path, st, is_dir=False)
