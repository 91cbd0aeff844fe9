"""The package as a user installs it: sdist and wheel built by ``python -m build``, their metadata clean for
``twine check --strict``, the wheel installed into a fresh virtual environment (tests/freshinstall.py)
where the console script and the demo work."""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import urllib.request
import zipfile

import pytest
from freshinstall import Demo, FreshInstall

from gpu_energy_exporter import __version__

pytestmark = pytest.mark.slow


def test_sdist_and_wheel_pass_twine_check(fresh_install: FreshInstall) -> None:
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", str(fresh_install.sdist),
                          str(fresh_install.wheel)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASSED") == 2


def test_wheel_carries_the_data_files_and_the_base_dependencies(fresh_install: FreshInstall) -> None:
    with zipfile.ZipFile(fresh_install.wheel) as whl:
        names = set(whl.namelist())
        meta = whl.read(f"gpu_energy_exporter-{__version__}.dist-info/METADATA").decode()
    for needed in ("gpu_energy_exporter/py.typed", "gpu_energy_exporter/reference/data/SOURCES.md",
                   "gpu_energy_exporter/devices/simulated.py", "gpu_energy_exporter/client/api.py"):
        assert needed in names
    assert any(n.startswith("gpu_energy_exporter/reference/data/") and n.endswith(".csv") for n in names)
    assert not any(n.startswith("tests/") for n in names)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    base = [r for r in requires if "extra ==" not in r]
    # the demo's trainer and the training helper need the OpenTelemetry SDK: base install, not an extra
    assert any(r.startswith("opentelemetry-sdk") for r in base)
    assert any(r.startswith("opentelemetry-exporter-otlp-proto-http") for r in base)
    assert not any(r.startswith(("torch", "transformers", "lightning", "matplotlib")) for r in base)
    with tarfile.open(fresh_install.sdist) as sdist:
        assert any(n.endswith("/pyproject.toml") for n in sdist.getnames())


def test_installed_console_script_reports_its_version(fresh_install: FreshInstall) -> None:
    out = fresh_install.run("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"gpu-energy-exporter {__version__}"
    # the installed package, not this checkout
    code = "import gpu_energy_exporter; print(gpu_energy_exporter.__file__)"
    where = subprocess.run([fresh_install.bin("python"), "-c", code], capture_output=True, text=True, timeout=60,
                           cwd=fresh_install.home, env=fresh_install.env())
    assert str(fresh_install.venv) in where.stdout


def test_installed_demo_serves_simulated_gpus(fresh_install: FreshInstall) -> None:
    demo = Demo(fresh_install, ["--web.listen-address=127.0.0.1:0", "--otlp.listen-address=127.0.0.1:0",
                                "--demo.pause=1s", "--demo.run-duration=3s", "--demo.runs=1",
                                "--demo.export-interval=500ms"])
    try:
        url = demo.url()
        with urllib.request.urlopen(url + "/api/v1/status", timeout=10) as resp:
            assert json.load(resp)["simulated"] is True
        demo.wait_for("finished after", 30)  # "demo: simulated run ... finished after N steps"
    finally:
        rc = demo.stop()
    assert rc == 0, demo.log()
    assert "level=error" not in demo.log() and "Traceback" not in demo.log()
