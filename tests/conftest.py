"""Shared fixtures: the fake NVML library, an exporter subprocess per test.

Plain helpers (free ports, waits, the exporter process wrapper, exposition parsing) live in helpers.py,
importable by the benchmarks too; this file keeps what needs pytest. Everything starts real processes on
127.0.0.1 with ephemeral ports and stops them at the end of the test; nothing is mocked.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from fakenvml import build_library  # noqa: E402
from freshinstall import fresh_install  # noqa: E402, F401 - a session fixture shared by two test files
from helpers import ExporterProcess  # noqa: E402

# The OTLP/gRPC receiver is on by default at localhost:4317: exporters started by tests (in-process or as
# children, which inherit this) leave it off unless the test turns it on with the flag, which wins over the
# environment, so tests never contend for port 4317 (with each other, or with a Collector on this host).
os.environ.setdefault("GPU_ENERGY_EXPORTER_OTLP_GRPC_LISTEN_ADDRESS", "")


@pytest.fixture(scope="session")
def fake_nvml_lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1, compiled once per session with the system C compiler."""
    return build_library(tmp_path_factory.mktemp("fakenvml"))


@pytest.fixture
def start_exporter() -> Iterator[type[ExporterProcess]]:
    started: list[ExporterProcess] = []

    class _Tracked(ExporterProcess):
        def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*a, **kw)
            started.append(self)

    yield _Tracked
    for p in started:
        p.stop()


# ----------------------------------------------------------------------------------------------------
# the two tiers: `make test-fast` runs `-m "not full"` (pure and in-process tests: no other process, no
# Prometheus, no torch; under 2 minutes on two cores), `make test` runs everything.

#: What puts a test file in the full tier only: it starts another process (an exporter, Prometheus, promtool,
#: Slurm, a container build, a fresh install) or trains with torch.
FULL_TIER = re.compile(r"\bsubprocess\b|\bPopen\b|\bstart_exporter\b|\bExporterProcess\b|\bpromtool\b|"
                       r"^from prom import|^import torch|\btraining_models\b|\bbuildah\b|\bfresh_install\b|"
                       r"\bmultiprocessing\b|\btmux\b", re.MULTILINE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    full: dict[Path, bool] = {}
    for item in items:
        path = Path(item.path)
        if path not in full:
            full[path] = bool(FULL_TIER.search(path.read_text(encoding="utf-8")))
        if full[path]:
            item.add_marker(pytest.mark.full)
