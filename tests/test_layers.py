"""The package's layers (issue 14): each folder is a layer and imports only point down.

The contract is ``[tool.importlinter]`` in pyproject.toml (README, "Where things are"); this runs the real
``lint-imports`` over the working tree, as ``make lint`` does, and checks that no hand-written module has
grown past what one sitting can read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "gpu_energy_exporter"
#: Generated code (protoc) is not read by people.
GENERATED = {"podresources_pb2.py", "podresources_pb2_grpc.py"}
MAX_LINES = 500


def test_imports_respect_the_layer_contract() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "broken" not in done.stdout.lower() or " 0 broken" in done.stdout, done.stdout


def test_every_folder_of_the_package_is_a_contract_layer() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    folders = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    missing = [f for f in folders if f'"gpu_energy_exporter.{f}' not in pyproject]
    assert not missing, f"folders outside the layer contract: {missing}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert not loose, f"modules at the top of the package, outside every layer: {loose}"


def test_no_hand_written_module_is_longer_than_one_sitting() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for p in PACKAGE.rglob("*.py") if p.name not in GENERATED}
    long = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"


#: Where things were before issue 32's restructuring: nothing may live or be imported there again.
OLD_PLACES = {
    "gpu_energy_exporter.core.config": "gpu_energy_exporter.daemon.config (the daemon's configuration)",
    "gpu_energy_exporter.core.inertflags": "gpu_energy_exporter.daemon.inertflags",
    "gpu_energy_exporter.daemon.demo": "gpu_energy_exporter.tools.demo (never imported by the daemon)",
    "gpu_energy_exporter.daemon.docgen": "gpu_energy_exporter.tools.docgen (never imported by the daemon)",
    "gpu_energy_exporter.kubernetes": "gpu_energy_exporter.collectors.kubernetes (its collector included)",
    "gpu_energy_exporter.slurm": "gpu_energy_exporter.collectors.slurm (its collector included)",
    "gpu_energy_exporter.collectors.health_metrics": "gpu_energy_exporter.collectors.health.metrics",
    "gpu_energy_exporter.core.memo": "gpu_energy_exporter.core.bounded_memo",
    "gpu_energy_exporter.otlp.folding": "gpu_energy_exporter.otlp.temporality",
    "gpu_energy_exporter.otlp.grpcwake": "gpu_energy_exporter.otlp.grpc_port_holder",
    "gpu_energy_exporter.otlp.grpcslots": "gpu_energy_exporter.otlp.grpc_admission",
    "gpu_energy_exporter.daemon.lean": "gpu_energy_exporter.daemon.lean_imports",
    "gpu_energy_exporter.ledger.frames": "gpu_energy_exporter.ledger.snapshot_frames",
    "gpu_energy_exporter.ledger.claims": "gpu_energy_exporter.ledger.process_claims",
    "gpu_energy_exporter.ledger.views": "gpu_energy_exporter.ledger.served_views",
}


def test_nothing_lives_or_is_imported_in_the_old_places() -> None:
    for old, new in OLD_PLACES.items():
        path = ROOT / old.replace(".", "/")
        assert not path.with_suffix(".py").exists() and not path.is_dir(), f"{path} is back: it belongs in {new}"
    users = [f"{p.relative_to(ROOT)}: {old}" for p in [*ROOT.glob("gpu_energy_exporter/**/*.py"),
                                                       *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/**/*.py")]
             for old in OLD_PLACES if p != Path(__file__)
             and re.search(re.escape(old) + r"\b(?!\.collector)", p.read_text(encoding="utf-8"))]
    assert not users, f"imports of the old places: {users}"


def test_the_daemon_never_imports_the_tools() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    layers = pyproject.split('type = "layers"', 1)[1].split("]", 1)[0]
    assert layers.index('"gpu_energy_exporter.tools"') < layers.index('"gpu_energy_exporter.daemon"')
