"""The peers' virtual environments: each peer is installed from PyPI into its own venv under .bench-venvs/.

``python_for(name)`` returns the venv's interpreter, creating the venv and running pip the first time, or a
``PeerUnavailable`` whose message says precisely why it could not be installed (pip's last lines). Versions
are pinned so that figures name what they measured; change ``PEERS`` to measure newer releases.

Own venvs, not the project's: the peers pin their own nvidia-ml-py / prometheus-client / numpy versions,
and none of them may end up importable by the exporter's tests. This module never installs anything into
the project's environment and never touches a registry other than through pip.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from bench.harness import PEER_VENVS


@dataclass(frozen=True)
class Peer:
    name: str
    requirement: str
    import_name: str


PEERS: dict[str, Peer] = {
    "zeus": Peer("zeus", "zeus==0.16.0", "zeus"),
    "codecarbon": Peer("codecarbon", "codecarbon==3.3.2", "codecarbon"),
    "nvitop-exporter": Peer("nvitop-exporter", "nvitop-exporter==1.7.2", "nvitop_exporter"),
}

#: Scripts run inside the peers' venvs (they import only the peer and the standard library).
SCRIPTS = Path(__file__).resolve().parent / "peer_scripts"


class PeerUnavailable(Exception):
    """The peer could not be installed or imported; the message says why."""


def venv_dir(name: str) -> Path:
    return PEER_VENVS / name


def python_for(name: str, install: bool = True) -> Path:
    """The interpreter of the peer's venv, installing it first when needed (and allowed)."""
    peer = PEERS[name]
    root = venv_dir(name)
    python = root / "bin" / "python"
    stamp = root / ".bench-installed"
    if python.exists() and stamp.exists() and stamp.read_text().strip() == peer.requirement:
        return python
    if not install:
        raise PeerUnavailable(f"{peer.requirement} is not installed in {root} (run the full benchmark to install it)")
    root.parent.mkdir(parents=True, exist_ok=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(root)],
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", peer.requirement],
        [str(python), "-c", f"import {peer.import_name}"],
    ]
    for cmd in steps:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-8:])
            raise PeerUnavailable(f"`{' '.join(cmd[-3:])}` failed (exit {proc.returncode}): {tail}")
    stamp.write_text(peer.requirement + "\n")
    return python


def version_of(name: str) -> str:
    return PEERS[name].requirement
