"""The container image, built from the project's Dockerfile by a real OCI builder (buildah) and run.

No image registry is reachable here, so the base image is a stand-in made from Debian's packages
(``debootstrap --variant=minbase`` with python3, venv and pip, a ``python`` link and this machine's CA
bundle so that pip inside the build reaches the package index), imported into buildah's storage and
passed as ``--build-arg PYTHON_IMAGE``. The base is cached (``$GEE_CONTAINER_CACHE``, default
``~/.cache/gpu-energy-exporter/container``, about 200 MB, and buildah's own image store under
/var/lib/containers or ~/.local/share/containers), so only the first run on a machine pays for debootstrap
(about 1.5 min); the build itself takes about a minute. The arm64 build is tests/test_container_arm64.py.

The image then runs under ``buildah run --isolation chroot`` with the fake NVML library and a scenario
mounted: ``/metrics`` serves the fake GPUs, the process runs as uid 10001, nothing is written outside the
declared volume, the image's HEALTHCHECK command succeeds, and a run pushed over OTLP by the real
training helper reaches the ledger file in the volume. ``make test-container`` runs just this file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from fakenvml import Constant, Scenario, h100
from helpers import free_port, poll, sample_value

pytestmark = [pytest.mark.slow, pytest.mark.container]

REPO = Path(__file__).resolve().parent.parent
BASE_IMAGE = "localhost/gpu-energy-exporter-test-base:bookworm"
#: One tag per test process, so two checkouts testing at once never run each other's image.
IMAGE = f"localhost/gpu-energy-exporter:test-{os.getpid()}"
VOLUME = "/var/lib/gpu-energy-exporter"
SUITE = "bookworm"
#: What docs/deploy.md states as the image size; the test fails when a measured size drifts from it.
DOCS = REPO / "docs" / "deploy.md"


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: `make test` installs it (.ci/setup-test-env), or apt-get install {name}")
    return path


def buildah(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [_tool("buildah"), "--storage-driver", "vfs", *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def debian_mirror() -> str:
    """The Debian mirror this machine's apt uses (deb822 sources or sources.list)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        text = path.read_text()
        for block in text.split("\n\n"):
            if re.search(r"^Suites:.*\b" + SUITE + r"\b", block, re.M) and "security" not in block:
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m:
                    return m.group(1)
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                return parts[1]
    return "http://deb.debian.org/debian"


def _image_exists(name: str) -> bool:
    return buildah("inspect", "--type", "image", name, check=False).returncode == 0


#: Debian's name for each architecture the image is built for (docs/deploy.md, "Images"): linux/amd64 and
#: linux/arm64 (Grace Hopper, Grace Blackwell). arm64 is built under qemu-user-static's emulation
#: (tests/test_container_arm64.py).
NATIVE_ARCH = "amd64"


def container_cache() -> Path:
    """Where the debootstrap'd base tarballs are kept between runs (about 200 MB each; docs/deploy.md)."""
    return Path(os.environ.get("GEE_CONTAINER_CACHE", Path.home() / ".cache" / "gpu-energy-exporter" / "container"))


def make_base_image(arch: str = NATIVE_ARCH) -> str:
    """The stand-in Python base image for ``arch`` in buildah's store, debootstrapped on first use."""
    name = BASE_IMAGE if arch == NATIVE_ARCH else f"{BASE_IMAGE}-{arch}"
    if _image_exists(name):
        return name
    cache = container_cache()
    tarball = cache / (f"debian-{SUITE}-python3.tar" if arch == NATIVE_ARCH else f"debian-{SUITE}-{arch}-python3.tar")
    if not tarball.exists():
        cache.mkdir(parents=True, exist_ok=True)
        rootfs = cache / f"rootfs-{arch}.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        # For a foreign architecture debootstrap runs the second stage through binfmt_misc and
        # qemu-user-static (registered with the F flag, so nothing is copied into the rootfs).
        subprocess.run(
            [_tool("debootstrap"), f"--arch={arch}", "--variant=minbase",
             "--include=python3,python3-venv,python3-pip,ca-certificates", SUITE, str(rootfs), debian_mirror()],
            check=True, capture_output=True, timeout=900,
        )
        (rootfs / "usr/bin/python").symlink_to("python3")
        ca = Path("/etc/ssl/certs/ca-certificates.crt")
        if ca.exists():  # this machine's trust store, so pip inside the build reaches the package index
            shutil.copy(ca, rootfs / "etc/ssl/certs/ca-certificates.crt")
        for leftovers in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for f in (rootfs / leftovers).glob("*"):
                if f.is_file():
                    f.unlink()
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball) + ".tmp", "."], check=True, timeout=300)
        os.replace(str(tarball) + ".tmp", tarball)
        shutil.rmtree(rootfs, ignore_errors=True)
    ctr = buildah("from", "scratch").stdout.strip()
    try:
        buildah("add", ctr, str(tarball), "/")
        buildah("config", "--arch", arch, "--os", "linux",
                "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr)
        buildah("commit", "-q", ctr, name)
    finally:
        buildah("rm", ctr, check=False)
    return name


@pytest.fixture(scope="module")
def base_image() -> str:
    return make_base_image()


@pytest.fixture(scope="module")
def image(base_image: str) -> Iterator[str]:
    start = time.monotonic()
    buildah("bud", "--format", "docker", "--isolation", "chroot", "--network", "host",
            "--build-arg", f"PYTHON_IMAGE={base_image}", "-t", IMAGE, "-f", str(REPO / "Dockerfile"), str(REPO),
            timeout=900)
    print(f"image built in {time.monotonic() - start:.0f}s")
    yield IMAGE
    buildah("rmi", IMAGE, check=False)
    buildah("rmi", "--prune", check=False)  # untagged intermediate images


def _config(image: str) -> dict:
    return json.loads(buildah("inspect", "--type", "image", image).stdout)["Docker"]["config"]


def image_size_mb(image: str) -> float:
    """buildah reports sizes the way docker does (decimal units, e.g. "252 MB")."""
    rows = json.loads(buildah("images", "--json", image).stdout)
    m = re.fullmatch(r"([\d.]+)\s*([kMG]?B)", str(rows[0]["size"]).strip())
    assert m, rows[0]["size"]
    return float(m.group(1)) * {"B": 1e-6, "kB": 1e-3, "MB": 1.0, "GB": 1e3}[m.group(2)]


def test_image_size_is_what_the_docs_say(image: str, base_image: str) -> None:
    size, base = image_size_mb(image), image_size_mb(base_image)
    print(f"image {size:.0f} MB, of which {size - base:.0f} MB above the base")
    m = re.search(r"adds about (\d+) MB", DOCS.read_text())
    assert m, "docs/deploy.md must state the size the image adds above its base ('adds about N MB')"
    assert abs((size - base) - float(m.group(1))) <= max(10.0, 0.2 * float(m.group(1))), (
        f"the image adds {size - base:.0f} MB above its base; docs/deploy.md says {m.group(1)} MB")


def test_image_config_is_what_the_deployment_expects(image: str) -> None:
    cfg = _config(image)
    assert cfg["User"] == "10001:10001"
    assert list(cfg["Volumes"]) == [VOLUME]
    assert cfg["Entrypoint"] == ["/opt/gpu-energy-exporter/bin/gpu-energy-exporter"]
    assert cfg["Healthcheck"]["Test"][0] == "CMD"
    assert {"9863/tcp", "4318/tcp", "4317/tcp"} <= set(cfg["ExposedPorts"])


def _exporter_uids() -> list[int]:
    uids = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0] == "buildah-chroot-exec" and any("gpu-energy-exporter" in c for c in cmd):
            uids.append(p.info["uids"].real)
    return uids


def test_the_image_serves_fake_gpus_as_uid_10001_writes_only_its_volume_and_keeps_a_pushed_run(
    image: str, fake_nvml_lib: Path, tmp_path: Path
) -> None:
    from gpu_energy_exporter.training import start_run

    lib_dir, volume = tmp_path / "nvml", tmp_path / "volume"
    lib_dir.mkdir()
    volume.mkdir()
    os.chown(volume, 10001, 10001)
    shutil.copy(fake_nvml_lib, lib_dir / "libnvidia-ml.so.1")
    gpus = [h100(0, power=Constant(300.0))]
    Scenario(epoch=time.time() - 60, gpus=gpus).write(lib_dir / "scenario.ini")
    (lib_dir / "scenario.ini").chmod(0o644)  # written 0600; the container runs as uid 10001
    web, otlp = free_port(), free_port()

    ctr = buildah("from", image).stdout.strip()
    # `buildah run` mounts an anonymous volume for each VOLUME of the image and, with more than one -v, may
    # lay it over our bind mount of the same path (seen here: the ledger wrote into buildah's own volume).
    # The image's VOLUME is checked above; the working container drops it so that our bind mount is the one.
    buildah("config", "--volume", f"{VOLUME}-", ctr)
    mnt = Path(buildah("mount", ctr).stdout.strip())
    marker = mnt / "tmp" / ".before-run"
    marker.touch()
    time.sleep(1.1)
    proc = subprocess.Popen(
        [_tool("buildah"), "--storage-driver", "vfs", "run", "--isolation", "chroot", "--network", "host",
         "-v", f"{lib_dir}:/opt/fakenvml:ro", "-v", f"{volume}:{VOLUME}",
         "-e", "LD_LIBRARY_PATH=/opt/fakenvml", "-e", "FAKE_NVML_SCENARIO=/opt/fakenvml/scenario.ini",
         "-e", f"GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS=127.0.0.1:{web}",
         "-e", f"GPU_ENERGY_EXPORTER_OTLP_LISTEN_ADDRESS=127.0.0.1:{otlp}",
         "-e", "GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS=",
         ctr, "--", "/opt/gpu-energy-exporter/bin/gpu-energy-exporter", "--collector.interval=200ms",
         "--runs.stale-after=30s"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/metrics", timeout=5) as resp:
                return resp.read().decode()

        def serving() -> bool:
            try:
                return sample_value(metrics(), "gpuenergy_gpu_up", gpu_uuid=gpus[0].uuid) == 1.0
            except OSError:
                return False

        if not poll(serving, 60, 0.3):
            proc.terminate()
            raise AssertionError("the container did not serve the fake GPU within 60 s:\n" + proc.communicate()[0])
        assert sample_value(metrics(), "gpuenergy_gpu_power_watts", gpu="0") == pytest.approx(300.0)
        assert _exporter_uids() and set(_exporter_uids()) == {10001}

        health = _config(image)["Healthcheck"]["Test"][1:]
        out = buildah("run", "--isolation", "chroot", "--network", "host",
                      "-e", f"GPU_ENERGY_EXPORTER_WEB_LISTEN_ADDRESS=127.0.0.1:{web}", ctr, "--", *health,
                      check=False, timeout=60)
        assert out.returncode == 0, out.stdout + out.stderr

        with start_run("container-run", model="tiny", endpoint=f"http://127.0.0.1:{otlp}",
                       gpu_uuids=[gpus[0].uuid], export_interval=1.0) as run:
            for _ in range(5):
                run.step(tokens=1000, samples=4, loss=1.0)
                time.sleep(0.4)
        if not poll(lambda: (volume / "runs.csv").exists() and "container-run" in (volume / "runs.csv").read_text(),
                    120):
            with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/runs", timeout=5) as resp:
                runs = resp.read().decode()
            proc.terminate()
            listing = sorted(str(p.relative_to(volume)) for p in volume.rglob("*"))
            raise AssertionError(f"the run never reached runs.csv in the volume (it holds {listing}); the ledger "
                                 f"says {runs}\n"
                                 + proc.communicate(timeout=20)[0])
    finally:
        if proc.poll() is None:
            proc.terminate()
        try:
            log, _ = proc.communicate(timeout=20)
        except (subprocess.TimeoutExpired, ValueError):
            proc.kill()
            log = ""
        written = [
            str(p.relative_to(mnt)) for p in mnt.rglob("*")
            if p.is_file() and not p.is_symlink() and p.stat().st_mtime > marker.stat().st_mtime
            and not str(p.relative_to(mnt)).startswith(("proc/", "sys/", "dev/", "run/"))
        ]
        buildah("umount", ctr, check=False)
        buildah("rm", ctr, check=False)
    assert written == [], f"the container wrote outside {VOLUME}: {written}\n{log}"
    assert "Traceback" not in log, log
