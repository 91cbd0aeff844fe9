"""Every driver generation keeps every reading it can give: the whole exporter, as a process, on each fake.

For each ``fakenvml.generations.GENERATIONS`` entry the exporter runs on a library built with that
generation's missing (and extra) symbols; the test fetches ``/metrics`` over HTTP and checks it twice:

- the families the generation can provide are there for every GPU, and the ones it cannot are not
  (``PROVIDES`` / ``LACKS`` below: the reviewed table of what each generation gives);
- the body, with the values that depend on the clock or the machine masked, equals the reviewed golden file
  ``tests/golden/drivers/<generation>.prom``. Regenerate with ``UPDATE_GOLDEN=1`` and review the diff.

Host and RAPL collectors are off: their values belong to the machine running the tests, not to the driver.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from fakenvml import build_library
from fakenvml.generations import BY_NAME, GENERATIONS, Generation
from helpers import SAMPLE_LINE, ExporterProcess, check_golden, normalise

from gpu_energy_exporter.collectors import gpu_metrics as g
from gpu_energy_exporter.collectors.health import metrics as h
from gpu_energy_exporter.core.state import GPU_SAMPLE_AGE

GOLDEN_DIR = Path(__file__).parent / "golden" / "drivers"
# The counter read every sample (--collector.energy-interval): the driver clock is frozen, and energy apportioned
# by power between reads would grow with the wall clock. GPM every sample too: the test waits for its second sample.
ARGS = ["--collector.interval=200ms", "--collector.energy-interval=200ms", "--collector.gpm-interval=200ms",
        "--collector.processes",
        "--gpu.idle-power=60", "--no-collector.host", "--no-collector.rapl"]

GPM = {s.name for s in g.GPM_SPECS.values()}
#: Every GPU of every generation shows these.
COMMON = {g.GPU_INFO.name, g.GPU_UP.name, GPU_SAMPLE_AGE.name, g.ENERGY.name, g.POWER_LIMIT.name,
          g.MEM_USED.name, g.MEM_TOTAL.name, g.TEMP.name, g.SM_CLOCK.name, g.MEM_CLOCK.name, g.CLOCK_EVENT.name,
          g.COMPUTE_PROCESSES.name, g.IDLE_POWER.name}
UTIL = {g.UTIL.name, g.MEM_UTIL.name}
HOPPER = COMMON | UTIL | GPM | {g.POWER.name, g.POWER_AVERAGE.name, g.ENERGY_RESETS.name, g.MEM_RESERVED.name,
                                g.MEM_TEMP.name}

#: GPU health (collector health), where the scenario scripts it (the Hopper generation).
HEALTH = {h.ECC_ERRORS.name, h.REMAPPED_ROWS.name, h.REMAP_PENDING.name, h.REMAP_FAILURE.name, h.PCIE_REPLAYS.name,
          h.PCIE_THROUGHPUT.name, h.PCIE_GEN.name, h.PCIE_GEN_MAX.name, h.PCIE_WIDTH.name, h.PCIE_WIDTH_MAX.name,
          h.NVLINK_UP.name, h.NVLINK_ERRORS.name, h.NVLINK_DATA.name, h.XID_WATCHED.name, h.XID_ERRORS.name,
          h.ECC_EVENTS.name}
#: What each generation provides, per GPU.
PROVIDES: dict[str, set[str]] = {
    "r470": COMMON | UTIL | {g.POWER.name, g.ENERGY_RESETS.name},
    "pre_volta": COMMON | UTIL | {g.POWER.name, g.MEM_RESERVED.name},
    "ampere": COMMON | UTIL | {g.POWER_AVERAGE.name, g.ENERGY_RESETS.name, g.MEM_RESERVED.name},
    "hopper": HOPPER | HEALTH,
    "grace_hopper": HOPPER | {g.MODULE_POWER.name},
    "mig": HOPPER - UTIL,
    "future": HOPPER,
}
#: What each generation must not show (no reading to base it on).
LACKS: dict[str, set[str]] = {
    "r470": GPM | (HEALTH - {h.XID_WATCHED.name})
    | {g.POWER_AVERAGE.name, g.MEM_RESERVED.name, g.MEM_TEMP.name, g.MODULE_POWER.name},
    "pre_volta": GPM | {g.POWER_AVERAGE.name, g.ENERGY_RESETS.name, g.MEM_TEMP.name, g.MODULE_POWER.name},
    "ampere": GPM | {g.POWER.name, g.MEM_TEMP.name, g.MODULE_POWER.name},
    "hopper": {g.MODULE_POWER.name},
    "grace_hopper": set(),
    "mig": UTIL | {g.MODULE_POWER.name},
    "future": {g.MODULE_POWER.name},
}

@pytest.fixture(scope="session")
def generation_library(fake_nvml_lib: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """One compiled library per (omit, extra) set, shared by the generations that need it."""
    built: dict[tuple[tuple[str, ...], tuple[str, ...]], Path] = {((), ()): fake_nvml_lib}

    def get(gen: Generation) -> Path:
        key = gen.library_key
        if key not in built:
            built[key] = build_library(tmp_path_factory.mktemp(f"fakenvml-{gen.name}"), omit=key[0], extra=key[1])
        return built[key]

    return get


def families(text: str) -> dict[str, set[str]]:
    """Sample name -> the ``gpu`` label values it has (``""`` for series without one)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = SAMPLE_LINE.match(line)
        if m and not line.startswith("#"):
            gpu = re.search(r'[{,]gpu="([^"]*)"', m.group(2) or "")
            out.setdefault(m.group(1), set()).add(gpu.group(1) if gpu else "")
    return out


def _missing(text: str, gen: Generation) -> list[str]:
    got = families(text)
    want_gpus = {str(x.index) for x in gen.gpus}
    missing = [f"{name} (gpu {sorted(want_gpus - got.get(name, set()))})" for name in sorted(PROVIDES[gen.name])
               if not want_gpus <= got.get(name, set())]
    for x in gen.gpus:
        if x.processes and str(x.index) not in got.get(g.PROCESS_MEMORY.name, set()):
            missing.append(f"{g.PROCESS_MEMORY.name} (gpu {x.index})")
    return missing


def scrape(gen: Generation, lib: Path, tmp_path: Path, start: type[ExporterProcess]) -> tuple[str, ExporterProcess]:
    path = tmp_path / "scenario.ini"
    gen.scenario().write(path)
    exp = start([f"--nvml.library={lib}", *ARGS], {"FAKE_NVML_SCENARIO": str(path)}).wait_ready()
    # Until every family the generation provides is there (GPM needs two samples 100 ms apart), then one more
    # sample so that nothing is caught half way; bounded, so a broken exporter fails in seconds.
    deadline = time.monotonic() + 10.0
    text = exp.metrics()
    while _missing(text, gen) and time.monotonic() < deadline:
        time.sleep(0.1)
        text = exp.metrics()
    time.sleep(0.3)
    return exp.metrics(), exp


def test_the_matrix_covers_every_generation() -> None:
    assert set(PROVIDES) == set(LACKS) == set(BY_NAME)
    for gen in GENERATIONS:
        assert PROVIDES[gen.name] & LACKS[gen.name] == set(), gen.name


@pytest.mark.parametrize("name", [gen.name for gen in GENERATIONS])
def test_driver_generation_serves_everything_it_can(name: str, generation_library, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                    start_exporter: type[ExporterProcess]) -> None:
    gen = BY_NAME[name]
    started = time.monotonic()
    text, exp = scrape(gen, generation_library(gen), tmp_path, start_exporter)
    up_s = time.monotonic() - started
    got = families(text)
    # The golden masks integrated energy (it depends on wall time); check its value here instead: the
    # scripted constant power times the time the exporter has been integrating, which is at most up_s.
    for x in gen.gpus:
        if x.index in gen.integrating():
            watts = x.power.watts  # type: ignore[attr-defined]
            joules = float(re.search(
                rf'gpuenergy_gpu_energy_joules_total{{gpu="{x.index}",[^}}]*}} (\S+)', text).group(1))  # type: ignore[union-attr]
            assert 0.0 < joules <= watts * up_s * 1.02, (joules, watts, up_s)
            assert joules >= watts * 0.05, (joules, watts)  # integrated over at least a sampler tick or two
    assert got.get("gpuenergy_collector_success") and 'gpuenergy_collector_success{collector="gpu"} 1.0' in text, \
        text + exp.log()
    assert _missing(text, gen) == [], exp.log()
    assert sorted(LACKS[gen.name] & set(got)) == []
    for x in gen.gpus:
        assert f'gpuenergy_gpu_up{{gpu="{x.index}",gpu_uuid="{x.uuid}"}} 1.0' in text
    assert "Traceback" not in exp.log()
    check_golden(normalise(text, integrating=[str(i) for i in gen.integrating()]), GOLDEN_DIR / f"{gen.name}.prom")
