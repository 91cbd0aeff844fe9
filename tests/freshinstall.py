"""A fresh install of the project, as a new user gets it: the sdist and wheel built from this checkout with
``python -m build``, and the wheel installed with the ``[report]`` extra (what ``make run`` installs) into a
new virtual environment that sees nothing of the test environment (no ``--system-site-packages``, no
``PYTHONPATH``, run from a directory outside the checkout).

Built once per test session (``fresh_install``) and shared by tests/test_packaging.py and
tests/test_first_five_minutes.py. Dependencies come from the package index pip is configured with (and its
cache), as for any user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import ExporterProcess

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FreshInstall:
    dist: Path  # the sdist and wheel
    venv: Path
    home: Path  # an empty working directory outside the checkout

    @property
    def sdist(self) -> Path:
        return next(self.dist.glob("gpu_energy_exporter-*.tar.gz"))

    @property
    def wheel(self) -> Path:
        return next(self.dist.glob("gpu_energy_exporter-*.whl"))

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def env(self, **extra: str) -> dict[str, str]:
        """The user's environment: none of the test run's Python settings."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "GPU_ENERGY_EXPORTER_", "VIRTUAL_ENV", "OTEL_"))}
        env["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env.update(extra)
        return env

    def run(self, *args: str, timeout: float = 120, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.bin("gpu-energy-exporter"), *args], capture_output=True, text=True,
                              timeout=timeout, cwd=self.home, env=self.env(**extra))


class Demo(ExporterProcess):
    """``gpu-energy-exporter demo ARGS`` of the fresh install (its console script, its environment, run from
    its home): the tests' exporter process wrapper, so that every wait is bounded (``wait_for``)."""

    def __init__(self, install: FreshInstall, args: list[str]) -> None:
        super().__init__(args, subcommand=("demo",), command=[install.bin("gpu-energy-exporter")],
                         environ=install.env(), cwd=install.home)

    def url(self) -> str:
        """The metrics server's base URL, once both servers listen."""
        return self.wait_ready(60).metrics_url

    def stop(self, timeout: float = 30.0) -> int:
        return super().stop(timeout)


def _run(cmd: list[str], timeout: float, cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}")


@pytest.fixture(scope="session")
def fresh_install(tmp_path_factory: pytest.TempPathFactory) -> FreshInstall:
    base = tmp_path_factory.mktemp("fresh-install")
    dist, venv, home = base / "dist", base / "venv", base / "home"
    home.mkdir()
    # Built from a copy: setuptools writes build/ and *.egg-info beside the pyproject.toml it builds, and an
    # egg-info in the checkout would look like an installed gpu-energy-exporter to anything with the
    # checkout on its path.
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".bench-venvs", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".whl", ".build"))
    _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)], 300, base)
    _run([sys.executable, "-m", "venv", str(venv)], 120, base)
    wheel = next(dist.glob("gpu_energy_exporter-*.whl"))
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"{wheel}[report]"], 400, base)
    return FreshInstall(dist, venv, home)
