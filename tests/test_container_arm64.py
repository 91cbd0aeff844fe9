"""The container image for linux/arm64 (Grace Hopper, Grace Blackwell nodes), built from the same
Dockerfile on an amd64 machine under emulation, and run there.

The Dockerfile has nothing architecture-specific: the base image and pip pick the arm64 Python and wheels.
Here the base is Debian's arm64 packages (``debootstrap --arch=arm64``, second stage run through
binfmt_misc and Debian's qemu-user-static), then ``buildah bud --arch arm64``; every RUN step executes
arm64 binaries under qemu. The built image must say it is arm64, its Python must be an aarch64 one, and
the exporter must start and serve ``/metrics`` (the demo's simulated GPUs: the fake NVML library is built
for this machine's architecture, so it cannot be loaded into an arm64 process).

Emulation makes this slow (the build takes several minutes on 2 cores, see docs/deploy.md), so it is
marked ``arm64`` and left out of ``make test``: ``make test-container`` runs it with the amd64 container
test, ``make test-arm64`` alone. It needs qemu-user-static registered with binfmt_misc
(.ci/setup-test-env installs qemu-user-static and binfmt-support).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import free_port, poll, sample_value
from test_container import REPO, _tool, buildah, make_base_image

pytestmark = [pytest.mark.slow, pytest.mark.container, pytest.mark.arm64]

ARCH = "arm64"
IMAGE = f"localhost/gpu-energy-exporter:test-{ARCH}-{os.getpid()}"
BINFMT = Path("/proc/sys/fs/binfmt_misc")


def _emulation_ready() -> None:
    """Fail (never skip: the set-up installs it) with what to do when arm64 binaries cannot run here."""
    entry = BINFMT / "qemu-aarch64"
    if not (BINFMT / "status").exists():
        pytest.fail(f"binfmt_misc is not mounted at {BINFMT}: mount -t binfmt_misc binfmt_misc {BINFMT} "
                    "(as root; a container needs it from its host)")
    if not entry.exists() or "enabled" not in entry.read_text():
        pytest.fail("no qemu-aarch64 interpreter registered with binfmt_misc: apt-get install qemu-user-static "
                    "binfmt-support (then update-binfmts --enable qemu-aarch64)")


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    _emulation_ready()
    start = time.monotonic()
    base = make_base_image(ARCH)
    print(f"arm64 base ready in {time.monotonic() - start:.0f}s")
    start = time.monotonic()
    buildah("bud", "--arch", ARCH, "--format", "docker", "--isolation", "chroot", "--network", "host",
            "--build-arg", f"PYTHON_IMAGE={base}", "-t", IMAGE, "-f", str(REPO / "Dockerfile"), str(REPO),
            timeout=1800)
    print(f"arm64 image built in {time.monotonic() - start:.0f}s")
    yield IMAGE
    buildah("rmi", IMAGE, check=False)
    buildah("rmi", "--prune", check=False)


def test_the_image_is_arm64_and_its_python_is_aarch64(image: str) -> None:
    info = json.loads(buildah("inspect", "--type", "image", image).stdout)
    assert info["OCIv1"]["architecture"] == ARCH
    assert info["OCIv1"]["os"] == "linux"
    out = buildah("run", "--isolation", "chroot", _ctr(image), "--",
                  "/opt/gpu-energy-exporter/bin/python", "-c",
                  "import platform, gpu_energy_exporter; print(platform.machine(), gpu_energy_exporter.__name__)",
                  timeout=300)
    assert out.stdout.split() == ["aarch64", "gpu_energy_exporter"]


_containers: list[str] = []


def _ctr(image: str) -> str:
    ctr = buildah("from", image).stdout.strip()
    buildah("config", "--volume", "/var/lib/gpu-energy-exporter-", ctr)
    _containers.append(ctr)
    return ctr


@pytest.fixture(autouse=True, scope="module")
def _remove_containers() -> Iterator[None]:
    yield
    for ctr in _containers:
        buildah("rm", ctr, check=False)


def test_the_arm64_exporter_starts_and_serves_metrics(image: str) -> None:
    web, otlp = free_port(), free_port()
    proc = subprocess.Popen(
        [_tool("buildah"), "--storage-driver", "vfs", "run", "--isolation", "chroot", "--network", "host",
         _ctr(image), "--", "/opt/gpu-energy-exporter/bin/gpu-energy-exporter", "demo",
         f"--web.listen-address=127.0.0.1:{web}", f"--otlp.listen-address=127.0.0.1:{otlp}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=10) as resp:
                return resp.read().decode()

        def serving() -> bool:
            try:
                return sample_value(metrics(), "gpuenergy_gpu_up", gpu="0") == 1.0
            except (OSError, KeyError, AssertionError):
                return False

        if not poll(serving, 240, 1.0):  # Python under qemu starts in tens of seconds
            proc.terminate()
            raise AssertionError("the arm64 exporter did not serve within 240 s:\n" + proc.communicate(timeout=30)[0])
        text = metrics()
        assert 'backend="simulated"' in text
        assert "gpuenergy_build_info{" in text
    finally:
        proc.terminate()
        try:
            log, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            log = ""
    assert "Traceback" not in log, log
