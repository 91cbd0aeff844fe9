"""The rapl collector against powercap trees: the bundled server fixture and trees written in tmp_path."""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import registry_of
from prometheus_client import CollectorRegistry, generate_latest

from gpu_energy_exporter.collectors.base import NoData
from gpu_energy_exporter.collectors.rapl import RaplCollector, read_sysfs
from gpu_energy_exporter.engine.sampler import COLLECTOR_SUCCESS, Sampler

FIXTURES = Path(__file__).parent / "fixtures"
SERVER = FIXTURES / "sysfs-rapl-server"
LOGGER = "gpu_energy_exporter.collectors.rapl"


def energy(reg: CollectorRegistry, zone: str) -> float | None:
    for metric in reg.collect():
        for s in metric.samples:
            if s.name == "gpuenergy_rapl_energy_joules_total" and s.labels["zone"] == zone:
                return s.value
    return None


def value(reg: CollectorRegistry, name: str, zone: str) -> float | None:
    for metric in reg.collect():
        for s in metric.samples:
            if s.name == name and s.labels["zone"] == zone:
                return s.value
    return None


def labels_of(reg: CollectorRegistry, zone: str) -> dict[str, str]:
    for metric in reg.collect():
        for s in metric.samples:
            if s.name == "gpuenergy_rapl_readable" and s.labels["zone"] == zone:
                return dict(s.labels)
    raise AssertionError(f"no readable series for {zone}")


def write_zone(sysfs: Path, zone: str, name: str, energy_uj: int, max_range_uj: int | None = 262143328850) -> Path:
    d = sysfs / "class" / "powercap" / zone
    d.mkdir(parents=True, exist_ok=True)
    (d / "name").write_text(name + "\n")
    (d / "energy_uj").write_text(f"{energy_uj}\n")
    if max_range_uj is not None:
        (d / "max_energy_range_uj").write_text(f"{max_range_uj}\n")
    return d


def set_energy(zone_dir: Path, energy_uj: int) -> None:
    (zone_dir / "energy_uj").write_text(f"{energy_uj}\n")


# -- the server fixture ---------------------------------------------------------------------------------


def test_server_fixture_zones_labels_and_joules() -> None:
    reg = registry_of(RaplCollector(sysfs=str(SERVER)).update())

    assert energy(reg, "intel-rapl:0") == 43157925414 / 1e6
    assert energy(reg, "intel-rapl:0:0") == 5834133270 / 1e6
    assert energy(reg, "intel-rapl:1") == 39581744110 / 1e6
    assert energy(reg, "intel-rapl:1:0") == 6212008312 / 1e6
    assert labels_of(reg, "intel-rapl:0") == {
        "zone": "intel-rapl:0", "domain": "package", "package": "0", "scope": "package"}
    assert labels_of(reg, "intel-rapl:1:0") == {
        "zone": "intel-rapl:1:0", "domain": "dram", "package": "1", "scope": "dram"}
    # The MMIO duplicate of package 0 and the control-type directory are not zones.
    zones = {s.labels["zone"] for m in reg.collect() for s in m.samples}
    assert zones == {"intel-rapl:0", "intel-rapl:0:0", "intel-rapl:1", "intel-rapl:1:0"}
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:0") == 1
    assert value(reg, "gpuenergy_rapl_wraps_total", "intel-rapl:0") == 0
    assert value(reg, "gpuenergy_rapl_resets_total", "intel-rapl:0") == 0


def test_help_text_warns_against_summing_domains() -> None:
    text = generate_latest(registry_of(RaplCollector(sysfs=str(SERVER)).update())).decode()
    help_line = next(line for line in text.splitlines() if line.startswith("# HELP gpuenergy_rapl_energy_joules"))
    assert "double counts" in help_line


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian prometheus package) not installed")
def test_exposition_passes_promtool_lint() -> None:
    text = generate_latest(registry_of(RaplCollector(sysfs=str(SERVER)).update()))
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert res.returncode == 0, res.stdout.decode() + res.stderr.decode()


# -- laptop-like tree: overlapping domains --------------------------------------------------------------


def test_overlapping_domains_are_labelled_by_scope(tmp_path: Path) -> None:
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    write_zone(tmp_path, "intel-rapl:0:0", "core", 600_000)
    write_zone(tmp_path, "intel-rapl:0:1", "uncore", 100_000)
    write_zone(tmp_path, "intel-rapl:1", "psys", 3_000_000)
    reg = registry_of(RaplCollector(sysfs=str(tmp_path)).update())

    assert labels_of(reg, "intel-rapl:0:0") == {
        "zone": "intel-rapl:0:0", "domain": "core", "package": "0", "scope": "package_part"}
    assert labels_of(reg, "intel-rapl:0:1")["scope"] == "package_part"
    assert labels_of(reg, "intel-rapl:1") == {
        "zone": "intel-rapl:1", "domain": "psys", "package": "", "scope": "platform"}
    assert energy(reg, "intel-rapl:1") == 3.0


def test_counter_advances_by_the_difference(tmp_path: Path) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 5_000_000)
    c = RaplCollector(sysfs=str(tmp_path))
    c.update()
    set_energy(z, 7_500_000)
    reg = registry_of(c.update())
    assert energy(reg, "intel-rapl:0") == 7.5


# -- the wrap -------------------------------------------------------------------------------------------


def test_crossing_the_wrap_is_exact(tmp_path: Path) -> None:
    # Counter range 0..1_000_000 µJ inclusive: the modulus is 1_000_001.
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 999_000, max_range_uj=1_000_000)
    c = RaplCollector(sysfs=str(tmp_path))
    assert energy(registry_of(c.update()), "intel-rapl:0") == 999_000 / 1e6

    set_energy(z, 500)  # 1_000 µJ up to the maximum, 1 µJ to roll over to 0, then 500
    reg = registry_of(c.update())
    assert energy(reg, "intel-rapl:0") == (999_000 + 1_000 + 1 + 500) / 1e6
    assert value(reg, "gpuenergy_rapl_wraps_total", "intel-rapl:0") == 1
    assert value(reg, "gpuenergy_rapl_resets_total", "intel-rapl:0") == 0

    set_energy(z, 2_500)
    reg = registry_of(c.update())
    assert energy(reg, "intel-rapl:0") == (1_000_501 + 2_000) / 1e6


def test_wrap_from_the_maximum_to_zero_counts_one_step(tmp_path: Path) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000, max_range_uj=1_000_000)
    c = RaplCollector(sysfs=str(tmp_path))
    c.update()
    set_energy(z, 0)
    reg = registry_of(c.update())
    assert energy(reg, "intel-rapl:0") == 1_000_001 / 1e6
    assert value(reg, "gpuenergy_rapl_wraps_total", "intel-rapl:0") == 1


def test_several_wraps_stay_monotonic(tmp_path: Path) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 0, max_range_uj=999)
    c = RaplCollector(sysfs=str(tmp_path))
    c.update()
    seen = []
    for raw in (600, 200, 900, 100, 100, 999, 0):
        set_energy(z, raw)
        seen.append(energy(registry_of(c.update()), "intel-rapl:0"))
    # True energy: +600, +600, +700, +200, +0, +899, +1 (µJ), modulus 1000.
    assert seen == [x / 1e6 for x in (600, 1200, 1900, 2100, 2100, 2999, 3000)]


def test_unreadable_max_range_counts_a_reset_and_adds_no_guess(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 800_000, max_range_uj=None)
    c = RaplCollector(sysfs=str(tmp_path))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        c.update()
        set_energy(z, 300)
        reg = registry_of(c.update())
        c.update()
    # Only what is known to have happened since the counter restarted (300 µJ) is added.
    assert energy(reg, "intel-rapl:0") == 800_300 / 1e6
    assert value(reg, "gpuenergy_rapl_resets_total", "intel-rapl:0") == 1
    assert value(reg, "gpuenergy_rapl_wraps_total", "intel-rapl:0") == 0
    notes = [r for r in caplog.records if "max_energy_range_uj unreadable" in r.getMessage()]
    assert len(notes) == 1


def test_max_range_that_is_not_a_number_is_treated_as_unknown(tmp_path: Path) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 800_000, max_range_uj=None)
    (z / "max_energy_range_uj").write_text("garbage\n")
    c = RaplCollector(sysfs=str(tmp_path))
    c.update()
    set_energy(z, 100)
    reg = registry_of(c.update())
    assert value(reg, "gpuenergy_rapl_resets_total", "intel-rapl:0") == 1
    assert energy(reg, "intel-rapl:0") == 800_100 / 1e6


# -- unreadable zones -----------------------------------------------------------------------------------


def _can_read_mode_000_files() -> bool:
    """True for root (or any process with CAP_DAC_OVERRIDE / CAP_DAC_READ_SEARCH), where chmod 000 blocks
    nothing."""
    with tempfile.TemporaryDirectory() as d:
        probe = Path(d) / "probe"
        probe.write_text("1")
        probe.chmod(0)
        try:
            probe.read_text()
        except PermissionError:
            return False
        return True


@pytest.mark.skipif(_can_read_mode_000_files(), reason="running as root (or with CAP_DAC_OVERRIDE): chmod 000 "
                    "does not stop this process from reading; test_permission_denied_is_reported_once covers "
                    "the same path with a denying reader")
def test_chmod_000_energy_file_is_a_real_permission_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    denied = write_zone(tmp_path, "intel-rapl:1", "package-1", 2_000_000)
    (denied / "energy_uj").chmod(0)
    c = RaplCollector(sysfs=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        c.update()
        reg = registry_of(c.update())
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:1") == 0
    assert energy(reg, "intel-rapl:1") is None
    assert energy(reg, "intel-rapl:0") == 1.0
    warnings = [r for r in caplog.records if "permission denied" in r.getMessage()]
    assert len(warnings) == 1


def denying(paths: set[str]) -> Callable[[str], str]:
    """A sysfs reader that answers like the kernel does for a root-only file read by a normal user."""

    def read(path: str) -> str:
        if path in paths:
            raise PermissionError(13, "Permission denied", path)
        return read_sysfs(path)

    return read


def test_permission_denied_is_reported_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ok = write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    d1 = write_zone(tmp_path, "intel-rapl:1", "package-1", 2_000_000)
    d2 = write_zone(tmp_path, "intel-rapl:1:0", "dram", 3_000_000)
    blocked = {str(d1 / "energy_uj"), str(d2 / "energy_uj")}
    c = RaplCollector(sysfs=str(tmp_path), read_text=denying(blocked))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            set_energy(ok, 1_500_000)
            reg = registry_of(c.update())
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "root" in message and "CAP_DAC_READ_SEARCH" in message and "udev" in message
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:1") == 0
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:1:0") == 0
    assert energy(reg, "intel-rapl:1") is None
    # The readable zone keeps working.
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:0") == 1
    assert energy(reg, "intel-rapl:0") == 1.5


def test_zone_recovers_when_permission_is_granted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    blocked = {str(z / "energy_uj")}
    c = RaplCollector(sysfs=str(tmp_path), read_text=denying(blocked))
    c.update()
    blocked.clear()  # e.g. a udev rule or a capability was added
    with caplog.at_level(logging.INFO, logger=LOGGER):
        reg = registry_of(c.update())
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:0") == 1
    assert energy(reg, "intel-rapl:0") == 1.0
    assert any("readable again" in r.getMessage() for r in caplog.records)


def test_energy_file_that_cannot_be_read_skips_only_that_zone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Works as root too: a directory where the attribute should be gives EISDIR, a dangling link ENOENT.
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    as_dir = write_zone(tmp_path, "intel-rapl:1", "package-1", 0)
    (as_dir / "energy_uj").unlink()
    (as_dir / "energy_uj").mkdir()
    dangling = write_zone(tmp_path, "intel-rapl:2", "package-2", 0)
    (dangling / "energy_uj").unlink()
    (dangling / "energy_uj").symlink_to(tmp_path / "nowhere")
    c = RaplCollector(sysfs=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        c.update()
        reg = registry_of(c.update())
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:1") == 0
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:2") == 0
    assert energy(reg, "intel-rapl:1") is None and energy(reg, "intel-rapl:2") is None
    assert energy(reg, "intel-rapl:0") == 1.0
    # One warning per failing zone, not one per update.
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_garbage_in_energy_file_is_not_a_crash(tmp_path: Path) -> None:
    z = write_zone(tmp_path, "intel-rapl:0", "package-0", 0)
    (z / "energy_uj").write_text("not a number\n")
    reg = registry_of(RaplCollector(sysfs=str(tmp_path)).update())
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:0") == 0


# -- no tree --------------------------------------------------------------------------------------------


def test_missing_powercap_tree_is_no_data_with_one_debug_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = RaplCollector(sysfs=str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(2):
            with pytest.raises(NoData):
                c.update()
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.DEBUG


def test_powercap_without_rapl_zones_is_no_data(tmp_path: Path) -> None:
    (tmp_path / "class" / "powercap" / "dtpm").mkdir(parents=True)
    with pytest.raises(NoData):
        RaplCollector(sysfs=str(tmp_path)).update()


def test_no_powercap_tree_reports_collector_success_0_as_its_help_says(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 12: the log said "/sys/class/powercap does not exist" while collector_success{rapl} was 1, and its
    # HELP says "0 if it failed or had nothing to read". Nothing at warning level either: no data is no error.
    sampler = Sampler([RaplCollector(sysfs=str(tmp_path))], interval=1.0)
    with caplog.at_level(logging.INFO):
        snap = sampler.sample_once()
    success = {tuple(s.labels.values()): s.value for f in snap.families for s in f.samples
               if s.name == "gpuenergy_collector_success"}
    assert success == {("rapl",): 0.0}
    assert "nothing to read" in COLLECTOR_SUCCESS.help
    assert [r for r in caplog.records if r.levelno >= logging.INFO] == []


def test_vanished_zone_drops_its_series(tmp_path: Path) -> None:
    write_zone(tmp_path, "intel-rapl:0", "package-0", 1)
    gone = write_zone(tmp_path, "intel-rapl:1", "package-1", 1)
    c = RaplCollector(sysfs=str(tmp_path))
    c.update()
    shutil.rmtree(gone)
    reg = registry_of(c.update())
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:1") is None
    assert value(reg, "gpuenergy_rapl_readable", "intel-rapl:0") == 1


def test_collector_declares_its_metrics() -> None:
    names = {s.name for s in RaplCollector(sysfs="/nonexistent").specs()}
    assert names == {"gpuenergy_rapl_energy_joules_total", "gpuenergy_rapl_readable",
                     "gpuenergy_rapl_wraps_total", "gpuenergy_rapl_resets_total"}
